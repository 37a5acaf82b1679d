"""Served instruct checkpoints chat as their authors chat with them: through
``examples/omni_dialogue.py`` served in process (the app ``omni serve`` builds, over httpx's
ASGI transport; ``OMNI_MODEL`` a tiny random Llama, Qwen2 or Qwen3 with a ChatML template and
a generation_config.json) and the official ``openai`` client, every turn of a 3-turn
conversation with a system message gives transformers' reply and prompt length
(``apply_chat_template(add_generation_prompt=True)`` + greedy ``generate``), streamed or
not, and turns 2 and 3 reuse the earlier turns' KV."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from omni.serve.openai import ChatPolicy
from tests._cli import run_omni
from tests.compute.checkpoint_builders import hf_chat, save_checkpoint
from tests.serve._inproc import served
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
TURNS = ["Hello world, how are you today?", "The quick brown fox.", "And the lazy dog?"]
SYSTEM = "You are a helpful assistant."
MAX_TOKENS = 12


def transformers_turn(directory: Path, messages: list[dict]) -> tuple[str, int]:
    """transformers' greedy reply text and the prompt's tokens for `messages`."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_dict=False)
    ids = hf_chat(directory, messages, max_new_tokens=MAX_TOKENS)
    return tokenizer.decode(ids, skip_special_tokens=True), len(prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_a_served_checkpoint_chats_through_its_template_as_transformers_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    directory = save_checkpoint(tmp_path / arch, arch, seed=1)
    monkeypatch.setenv("OMNI_MODEL", str(directory))
    async with served(DIALOGUE) as app, app.openai() as client:
        messages = [{"role": "system", "content": SYSTEM}]
        for number, text in enumerate(TURNS, 1):
            messages.append({"role": "user", "content": text})
            expected, prompt_tokens = transformers_turn(directory, messages)
            reply = await client.chat.completions.create(model="chat", messages=messages,
                                                         max_tokens=MAX_TOKENS)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in
                                await client.chat.completions.create(
                                    model="chat", messages=messages, max_tokens=MAX_TOKENS,
                                    stream=True) if chunk.choices])
            assert reply.choices[0].message.content == expected == streamed, number
            assert reply.usage.prompt_tokens == prompt_tokens, number
            if number > 1:
                assert reply.usage.prompt_tokens_details.cached_tokens > 0, number
            messages.append({"role": "assistant", "content": expected})


async def test_media_for_a_text_checkpoint_and_the_operators_system_prompt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = save_checkpoint(tmp_path / "qwen3", "qwen3", seed=2)
    monkeypatch.setenv("OMNI_MODEL", str(directory))
    async with served(DIALOGUE, chat=ChatPolicy(system_prompt=SYSTEM)) as app, \
            app.openai() as client:
        user = [{"role": "user", "content": TURNS[0]}]
        reply = await client.chat.completions.create(model="chat", messages=user,
                                                     max_tokens=MAX_TOKENS)
        expected, prompt_tokens = transformers_turn(
            directory, [{"role": "system", "content": SYSTEM}, *user])
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == prompt_tokens  # the operator's system message
        clip = io.BytesIO()
        with wave.open(clip, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(16_000)
            out.writeframes(b"\x00\x01" * 1600)
        wav = base64.b64encode(clip.getvalue()).decode()
        with pytest.raises(openai.BadRequestError, match="text model"):
            await client.chat.completions.create(model="chat", max_tokens=2, messages=[{
                "role": "user", "content": [{"type": "input_audio", "input_audio": {
                    "data": wav, "format": "wav"}}]}])


def test_the_dialogues_sessions_render_through_the_template(tmp_path: Path) -> None:
    """`omni run` of the dialogue on an instruct checkpoint (the command run in this
    process): each turn's prompt is the template's rendering of the session (transformers'
    length), turn 2 reuses turn 1."""
    directory = save_checkpoint(tmp_path / "qwen2", "qwen2", seed=3)
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(json.dumps({"session": "a", "text": t, "max_tokens": 6}) + "\n"
                             for t in TURNS[:2]))
    done = run_omni("run", str(DIALOGUE), "--inputs-json", str(turns), "--json", cwd=tmp_path,
                    env={"OMNI_MODEL": str(directory)})
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line)["output"] for line in done.stdout.splitlines())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    history = [{"role": "user", "content": TURNS[0]},
               {"role": "assistant", "content": first["reply"]},
               {"role": "user", "content": TURNS[1]}]
    for result, messages in ((first, history[:1]), (second, history)):
        assert result["prompt_tokens"] == len(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False))
    assert second["cached_tokens"] > 0
