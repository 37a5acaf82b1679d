"""The built-in speech decoder (shapes, determinism, chunking) and its WAV files."""

import wave

import numpy as np
import pytest

from omni.compute.speech import SAMPLE_RATE, SpeechDecoder, WavWriter, read_wav, write_wav

TOKENS = [5, 17, 300, 2, 511, 42, 42, 9]


@pytest.fixture(scope="module")
def decoder():
    return SpeechDecoder(512, seed=0)


def test_each_token_becomes_samples_per_token_float32_samples_in_range(decoder):
    samples = decoder.decode_chunk(TOKENS)
    assert samples.dtype == np.float32
    assert samples.shape == (len(TOKENS) * decoder.samples_per_token,)
    assert np.abs(samples).max() <= 0.5 + 1e-6
    assert np.abs(samples).mean() > 0.01  # it makes a sound
    assert decoder.seconds(len(TOKENS)) == pytest.approx(samples.size / SAMPLE_RATE)
    assert decoder.decode_chunk([]).shape == (0,)


def test_the_same_seed_gives_the_same_audio_and_another_seed_other_audio(decoder):
    again = SpeechDecoder(512, seed=0).decode_chunk(TOKENS)
    assert np.array_equal(decoder.decode_chunk(TOKENS), again)
    assert not np.allclose(SpeechDecoder(512, seed=1).decode_chunk(TOKENS), again)
    one, other = decoder.decode_chunk([5]), decoder.decode_chunk([6])
    assert not np.allclose(one, other)  # tokens sound different


def test_decoding_chunk_by_chunk_equals_decoding_at_once(decoder):
    whole = decoder.decode_chunk(TOKENS)
    chunks = np.concatenate([decoder.decode_chunk(TOKENS[i:i + 3])
                             for i in range(0, len(TOKENS), 3)])
    np.testing.assert_allclose(chunks, whole, atol=1e-6)


def test_bad_arguments_are_refused(decoder):
    with pytest.raises(ValueError, match="token id 512 is outside"):
        decoder.decode_chunk([1, 512])
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        SpeechDecoder(0)
    with pytest.raises(ValueError, match="Nyquist"):
        SpeechDecoder(16, sample_rate=4000)


def test_a_wav_file_round_trips_through_the_wave_module(decoder, tmp_path):
    samples = decoder.decode_chunk(TOKENS)
    path = tmp_path / "reply.wav"
    write_wav(path, samples)
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, SAMPLE_RATE)
        assert f.getnframes() == samples.size
    back, rate = read_wav(path)
    assert rate == SAMPLE_RATE
    np.testing.assert_allclose(back, samples, atol=1.0 / 32767)


def test_the_writer_appends_chunks_and_fixes_the_header_when_closed(decoder, tmp_path):
    path = tmp_path / "stream.wav"
    with WavWriter(path) as writer:
        for i in range(0, len(TOKENS), 4):
            writer.write(decoder.decode_chunk(TOKENS[i:i + 4]))
        assert writer.seconds == pytest.approx(decoder.seconds(len(TOKENS)))
    with wave.open(str(path), "rb") as f:
        assert f.getnframes() == len(TOKENS) * decoder.samples_per_token
    loud = np.array([2.0, -2.0, 0.25], dtype=np.float32)  # clipped, not wrapped around
    write_wav(tmp_path / "loud.wav", loud)
    np.testing.assert_allclose(read_wav(tmp_path / "loud.wav")[0], [1, -1, 0.25], atol=1e-4)


def _raw_wav(path, channels, width, frames=b"\0\0\0\0"):
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(frames)


def test_read_wav_says_what_is_wrong_with_a_file(tmp_path):
    with pytest.raises(ValueError, match=r"audio file not found: .*missing\.wav"):
        read_wav(tmp_path / "missing.wav")
    (tmp_path / "text.wav").write_text("not a wav file")
    with pytest.raises(ValueError, match=r"text\.wav is not a PCM WAV file"):
        read_wav(tmp_path / "text.wav")
    _raw_wav(tmp_path / "stereo.wav", 2, 2)
    with pytest.raises(ValueError, match="expected mono audio, got 2 channels"):
        read_wav(tmp_path / "stereo.wav")
    _raw_wav(tmp_path / "8bit.wav", 1, 1)
    with pytest.raises(ValueError, match="expected 16-bit PCM samples, got 8-bit"):
        read_wav(tmp_path / "8bit.wav")
    _raw_wav(tmp_path / "empty.wav", 1, 2, b"")
    with pytest.raises(ValueError, match="holds no audio samples"):
        read_wav(tmp_path / "empty.wav")
