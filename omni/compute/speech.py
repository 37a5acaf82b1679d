"""A small built-in speech decoder (token ids -> 16 kHz audio) and WAV files read and written.

Why built in: the dialogue demo and its tests must speak without downloads. `SpeechDecoder`
is an UNTRAINED module whose weights are drawn from a seed: it turns each token into a short
tone (an embedding, a two-layer MLP that picks a pitch and the weights of its harmonics, an
oscillator bank, ``tanh``), so the same tokens always give the same sound, in every process.
It does not say words. A real vocoder (or a speech head on the LLM's hidden states) takes its
place by offering the same `decode_chunk(token_ids) -> float32 samples`.

Each token's samples depend on that token only, so decoding a reply chunk by chunk as the
tokens stream in gives the same audio as decoding it at once. WAV files are 16-bit PCM mono,
read and written with the standard library's `wave` module.
"""

from __future__ import annotations

import math
import os
import wave
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from torch import nn

__all__ = ["SAMPLE_RATE", "SpeechDecoder", "WavWriter", "read_wav", "write_wav"]

SAMPLE_RATE = 16_000
_FADE_S = 0.004  # each token's tone fades in and out over 4 ms: no clicks between tokens
_LOWEST_HZ = 100.0  # pitches span two octaves from here
_PCM_MAX = 32767


class SpeechDecoder(nn.Module):
    """Token ids -> mono float32 samples in [-1, 1], `samples_per_token` per token.

    Args:
        vocab_size: token ids accepted are ``0 .. vocab_size - 1`` (the LLM's vocabulary).
        sample_rate: samples per second of the output.
        samples_per_token: samples one token becomes (800 at 16 kHz: 50 ms).
        hidden: width of the embedding and the MLP.
        harmonics: sinusoids per token (the highest stays below the Nyquist frequency).
        seed: the weights' seed; the same seed gives the same audio everywhere.
    """

    def __init__(self, vocab_size: int, *, sample_rate: int = SAMPLE_RATE,
                 samples_per_token: int = 800, hidden: int = 32, harmonics: int = 8,
                 seed: int = 0):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("sample_rate", sample_rate),
                            ("samples_per_token", samples_per_token), ("hidden", hidden),
                            ("harmonics", harmonics)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeechDecoder {name} must be a positive int, got {value!r}")
        if 4 * _LOWEST_HZ * harmonics >= sample_rate / 2:
            raise ValueError(f"{harmonics} harmonics of pitches up to {4 * _LOWEST_HZ:.0f} Hz "
                             f"do not fit below the Nyquist frequency of {sample_rate} Hz")
        self.vocab_size = vocab_size
        self.sample_rate = sample_rate
        self.samples_per_token = samples_per_token
        self.embed = nn.Embedding(vocab_size, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.Tanh(),
                                 nn.Linear(2 * hidden, 1 + harmonics))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param.shape[-1] if param.dim() > 1 else 1
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
        t = torch.arange(samples_per_token, dtype=torch.float64) / sample_rate
        fade = min(samples_per_token // 2, max(1, round(_FADE_S * sample_rate)))
        envelope = torch.ones(samples_per_token, dtype=torch.float64)
        ramp = 0.5 - 0.5 * torch.cos(torch.linspace(0, math.pi, fade, dtype=torch.float64))
        envelope[:fade] = ramp
        envelope[-fade:] = torch.minimum(envelope[-fade:], ramp.flip(0))
        self.register_buffer("_time", t, persistent=False)
        self.register_buffer("_envelope", envelope, persistent=False)
        self.register_buffer("_harmonic", torch.arange(1, harmonics + 1, dtype=torch.float64),
                             persistent=False)
        # float64: a token's sound must not depend on the other tokens of its chunk, and a
        # float32 rounding difference in a pitch grows past a 16-bit sample step over the few
        # hundred radians of phase a token spans.
        self.double().eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, samples_per_token]`` samples."""
        params = self.mlp(self.embed(token_ids))  # [T, 1 + harmonics]
        pitch = _LOWEST_HZ * 4.0 ** torch.sigmoid(params[:, :1])  # [T, 1]: 100..400 Hz
        weights = torch.softmax(params[:, 1:], dim=-1)  # [T, harmonics]
        phase = 2 * math.pi * pitch[:, :, None] * self._harmonic[None, :, None] * self._time
        tone = (weights[:, :, None] * torch.sin(phase)).sum(dim=1)  # [T, samples]
        return 0.5 * torch.tanh(2.0 * tone) * self._envelope

    def decode_chunk(self, token_ids: Sequence[int]) -> np.ndarray:
        """The samples of `token_ids` (float32, ``len(token_ids) * samples_per_token`` long).

        Raises:
            ValueError: a token id outside ``0 .. vocab_size - 1``.
        """
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the speech decoder's vocabulary "
                             f"(0..{self.vocab_size - 1})")
        if not ids:
            return np.zeros(0, dtype=np.float32)
        samples = self.forward(torch.tensor(ids, dtype=torch.long))
        return samples.reshape(-1).numpy().astype(np.float32)

    def seconds(self, num_tokens: int) -> float:
        """How long `num_tokens` tokens sound."""
        return num_tokens * self.samples_per_token / self.sample_rate


def _to_pcm16(samples: np.ndarray) -> bytes:
    array = np.asarray(samples, dtype=np.float32)
    if array.ndim != 1:
        raise ValueError(f"samples must be a 1-D array, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("samples must be finite")
    pcm = np.round(np.clip(array, -1.0, 1.0) * _PCM_MAX).astype("<i2")
    return pcm.tobytes()


class WavWriter:
    """A 16-bit PCM mono WAV file written chunk by chunk (`write`), finished by `close`.

    Use it as a context manager. The header's length is fixed up when the file is closed.
    """

    def __init__(self, path: str | os.PathLike[str], sample_rate: int = SAMPLE_RATE):
        self.path = Path(path)
        self.sample_rate = sample_rate
        self.num_samples = 0
        self._file = wave.open(str(self.path), "wb")
        self._file.setnchannels(1)
        self._file.setsampwidth(2)
        self._file.setframerate(sample_rate)

    def write(self, samples: np.ndarray) -> None:
        """Append float samples in [-1, 1] (values outside are clipped)."""
        data = _to_pcm16(samples)
        self._file.writeframes(data)
        self.num_samples += len(data) // 2

    @property
    def seconds(self) -> float:
        """Seconds of audio written so far."""
        return self.num_samples / self.sample_rate

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> WavWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def write_wav(path: str | os.PathLike[str], samples: np.ndarray,
              sample_rate: int = SAMPLE_RATE) -> None:
    """Write float samples in [-1, 1] as a 16-bit PCM mono WAV file."""
    with WavWriter(path, sample_rate) as writer:
        writer.write(samples)


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """A 16-bit PCM mono WAV file as (float32 samples in [-1, 1], sample rate).

    Raises:
        ValueError: no such file, not a WAV file, not 16-bit PCM, not mono, or no samples;
            the message names the file and what is wrong.
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ValueError(f"audio file not found: {name}")
    try:
        with wave.open(name, "rb") as file:
            channels, width = file.getnchannels(), file.getsampwidth()
            rate, frames = file.getframerate(), file.readframes(file.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{name} is not a PCM WAV file ({exc or 'truncated'})") from None
    if width != 2:
        raise ValueError(f"{name}: expected 16-bit PCM samples, got {8 * width}-bit")
    if channels != 1:
        raise ValueError(f"{name}: expected mono audio, got {channels} channels")
    samples = np.frombuffer(frames[: len(frames) // 2 * 2], dtype="<i2")
    if samples.size == 0:
        raise ValueError(f"{name} holds no audio samples")
    return np.clip(samples.astype(np.float32) / _PCM_MAX, -1.0, 1.0), rate
