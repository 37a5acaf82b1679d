"""A Qwen3-Omni checkpoint served: ``examples/omni_dialogue.py`` with ``OMNI_MODEL`` a tiny
random Qwen3-Omni (see tests/compute/omni_builders), the app ``omni serve`` builds, the
official ``openai`` client. Text + image + audio in, text + speech out: the reply's text and
its 24 kHz WAV are transformers' (`generate(return_audio=True)`, greedy thinker and talker,
the same voice); a streamed reply sends audio before its last text."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.compute.omni_builders import (
    hf_model,
    hf_processor,
    hf_speech,
    hf_thinker_tokens,
    save_omni_checkpoint,
)
from tests.serve._inproc import served
from tests.serve._media import png_data_url, wav_base64
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
IMAGE = (np.random.default_rng(0).random((40, 72, 3)) * 255).astype(np.uint8)
CLIP = (np.random.default_rng(1).standard_normal(16_000) * 0.1).astype(np.float32)
# what the server hears of CLIP sent as a 16-bit WAV (`wav_base64`)
AUDIO = (CLIP * 32767).astype("<i2").astype(np.float32) / 32768.0
TALKER = {"temperature": 0, "max_new_tokens": 20, "min_new_tokens": 5}


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        frames, rate = w.readframes(w.getnframes()), w.getframerate()
    return np.frombuffer(frames, dtype="<i2"), rate


def request(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(IMAGE)}},
        {"type": "input_audio", "input_audio": {"data": wav_base64(CLIP), "format": "wav"}},
        {"type": "text", "text": "What do you hear?"}]}]
    return {"model": "chat", "messages": messages, "max_tokens": 8, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"},
            "extra_body": {"stages": {"talker": TALKER}}, **extra}


def oracle_messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                         {"type": "text", "text": "What do you hear?"}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_omni_checkpoint(tmp_path_factory.mktemp("qwen3_omni_serve"))


async def test_text_image_and_audio_in_text_and_speech_out(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_MODEL", str(checkpoint))
    model, processor = hf_model(checkpoint), hf_processor(checkpoint)
    reply_ids, expected = hf_speech(model, processor, oracle_messages(), [IMAGE], [AUDIO],
                                    8, 20, 5, speaker="Chelsie")
    text = processor.tokenizer.decode(reply_ids, skip_special_tokens=True)
    async with served(DIALOGUE) as app, app.openai() as client:
        reply = await client.chat.completions.create(**request())
        message = reply.choices[0].message
        assert message.content == text == message.audio.transcript
        samples, rate = wav_samples(base64.b64decode(message.audio.data))
        assert rate == 24_000 and samples.size == expected.numel()
        pcm = (np.clip(expected.numpy(), -1, 1) * 32767.0).round()
        assert np.abs(samples.astype(np.float64) - pcm).max() <= 1
        assert reply.usage.completion_tokens == len(reply_ids)

        # streamed: audio comes before the reply's last text
        kinds = []
        async for chunk in await client.chat.completions.create(**request(stream=True)):
            delta = chunk.choices[0].delta if chunk.choices else None
            audio = getattr(delta, "audio", None) if delta is not None else None
            if audio:
                kinds.append("audio" if getattr(audio, "data", None) else "text")
        assert "audio" in kinds and kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index(
            "text")

        # a voice the checkpoint lacks, and talker sampling out of range: refused, by name
        with pytest.raises(openai.BadRequestError, match="unknown voice 'Nobody'"):
            await client.chat.completions.create(**request(audio={"voice": "Nobody",
                                                                  "format": "wav"}))
        with pytest.raises(openai.BadRequestError, match=r"stages\.talker"):
            await client.chat.completions.create(**request(
                extra_body={"stages": {"talker": {"temperature": -1}}}))


def test_the_dialogue_hears_sees_and_speaks(checkpoint: Path, tmp_path: Path) -> None:
    """`omni run` of the dialogue on a Qwen3-Omni checkpoint (the command run in this
    process): a turn with a WAV and an image answers as transformers' thinker does and
    writes a 24 kHz reply; the next turn reuses the first's KV, image and audio included."""
    from tests._cli import run_omni

    np.save(tmp_path / "image.npy", IMAGE)
    (tmp_path / "clip.wav").write_bytes(base64.b64decode(wav_base64(CLIP)))
    turns = [{"session": "a", "text": "What do you hear?", "audio": "clip.wav",
              "image": "image.npy", "max_tokens": 8},
             {"session": "a", "text": "And then?", "max_tokens": 8}]
    (tmp_path / "turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    done = run_omni("run", str(DIALOGUE), "--inputs-json", "turns.jsonl", "--json",
                    cwd=tmp_path, env={"OMNI_MODEL": str(checkpoint)})
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line)["output"] for line in done.stdout.splitlines())
    model, processor = hf_model(checkpoint), hf_processor(checkpoint)
    # the dialogue puts what it heard before what it saw, then the text
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                             {"type": "text", "text": "What do you hear?"}]}]
    expected = hf_thinker_tokens(model, processor, messages, [IMAGE], [AUDIO], 8)
    assert first["token_ids"] == expected[:len(first["token_ids"])]
    samples, rate = wav_samples((tmp_path / "a-1.wav").read_bytes())
    assert rate == 24_000 and samples.size > 0 and first["first_audio_s"] is not None
    assert second["cached_tokens"] > 0 and second["cached_tokens"] >= 16


@pytest.mark.proc
def test_a_real_omni_serve_process_speaks_as_transformers(checkpoint: Path) -> None:
    """The command itself (``OMNI_MODEL=DIR omni serve examples/omni_dialogue.py``) and the
    official client over real HTTP: the same reply and 24 kHz speech as transformers."""
    from tests.serve._server import running

    model, processor = hf_model(checkpoint), hf_processor(checkpoint)
    reply_ids, expected = hf_speech(model, processor, oracle_messages(), [IMAGE], [AUDIO],
                                    8, 20, 5, speaker="Chelsie")
    with running(DIALOGUE, env={"OMNI_MODEL": str(checkpoint)}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        reply = client.chat.completions.create(**request())
    message = reply.choices[0].message
    assert message.content == processor.tokenizer.decode(reply_ids, skip_special_tokens=True)
    samples, rate = wav_samples(base64.b64decode(message.audio.data))
    pcm = (np.clip(expected.numpy(), -1, 1) * 32767.0).round()
    assert rate == 24_000 and samples.size == pcm.size
    assert np.abs(samples.astype(np.float64) - pcm).max() <= 1
