"""``POST /v1/chat/completions`` on ``examples/omni_dialogue.py`` served in process (the app
``omni serve`` builds, over httpx's ASGI transport), driven by the official ``openai`` client:
replies, streams, spoken replies, the prefix cache across turns, images and audio in
messages, and the refusals. The client's own HTTP stack against a real server process:
tests/serve/test_openai_readme.py."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import AsyncIterator

import numpy as np
import openai
import pytest
import trio

from omni.serve.openai import ChatPolicy
from tests.serve._inproc import listening, served
from tests.serve._media import png_data_url, wav_base64
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
PAGE_SIZE = 16  # the example's KV page size
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client, its requests going to the app serving the dialogue example."""
    async with served(DIALOGUE) as app, app.openai() as client:
        yield client


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def test_a_reply_as_one_object(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model="chat", messages=user("Hi!"), **GREEDY)
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.model == "chat"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert 1 <= usage.completion_tokens <= 12
    assert choice.finish_reason == "stop" or usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


async def test_a_stream_carries_the_same_reply_and_the_usage_last(
        client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(model="chat", messages=user("Stream it"), **GREEDY)
    chunks = [c async for c in await client.chat.completions.create(
        model="chat", messages=user("Stream it"), stream=True,
        stream_options={"include_usage": True}, **GREEDY)]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    assert all(c.usage is None for c in chunks[:-1])


async def test_the_second_turn_reads_the_first_turns_pages_from_the_store(
        client: openai.AsyncOpenAI) -> None:
    messages = user("Tell me about paged KV caches, in detail please.")
    first = await client.chat.completions.create(model="chat", messages=messages, **GREEDY)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = await client.chat.completions.create(model="chat", messages=messages, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // PAGE_SIZE * PAGE_SIZE > 0
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


async def test_a_spoken_reply_is_a_wav_whose_transcript_is_the_text(
        client: openai.AsyncOpenAI) -> None:
    text = await client.chat.completions.create(model="chat", messages=user("Say it"), **GREEDY)
    spoken = await client.chat.completions.create(
        model="chat", messages=user("Say it"), modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"}, **GREEDY)
    audio = spoken.choices[0].message.audio
    assert audio.transcript == text.choices[0].message.content
    assert audio.id.startswith("audio_") and audio.expires_at > spoken.created
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 16000)
        assert wav.getnframes() > 0


async def test_a_spoken_stream_sends_pcm_deltas_and_the_transcript(
        client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(
        model="chat", messages=user("Say it"), modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"}, **GREEDY)
    chunks = [c async for c in await client.chat.completions.create(
        model="chat", messages=user("Say it"), modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"}, stream=True, **GREEDY)]
    deltas = [getattr(c.choices[0].delta, "audio", None) for c in chunks if c.choices]
    deltas = [d for d in deltas if d]
    pcm = b"".join(base64.b64decode(d.data) for d in deltas if d.data)
    transcript = "".join(d.transcript or "" for d in deltas)
    assert all(d.id == deltas[0].id for d in deltas)
    assert transcript == whole.choices[0].message.audio.transcript
    assert pcm == base64.b64decode(whole.choices[0].message.audio.data) and pcm


async def test_an_image_from_a_data_url_takes_its_place_in_the_prompt(
        client: openai.AsyncOpenAI) -> None:
    text_only = await client.chat.completions.create(model="chat", messages=user("What is it?"),
                                                     **GREEDY)
    pixels = np.random.default_rng(0).integers(0, 255, (32, 48, 3), dtype=np.uint8)
    content = [{"type": "image_url", "image_url": {"url": png_data_url(pixels)}},
               {"type": "text", "text": "What is it?"}]
    with_image = await client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": content}], **GREEDY)
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens


async def test_input_audio_takes_its_place_in_the_prompt(client: openai.AsyncOpenAI) -> None:
    tone = np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440).astype(np.float32) * 0.5
    content = [{"type": "input_audio", "input_audio": {"data": wav_base64(tone),
                                                       "format": "wav"}},
               {"type": "text", "text": "What is it?"}]
    heard = await client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": content}], **GREEDY)
    text_only = await client.chat.completions.create(model="chat", messages=user("What is it?"),
                                                     **GREEDY)
    assert heard.usage.prompt_tokens > text_only.usage.prompt_tokens


async def test_n_choices_share_one_prompt(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model="chat", messages=user("Pick"), n=3,
                                                 temperature=1.0, seed=7, max_tokens=6)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 18
    again = await client.chat.completions.create(model="chat", messages=user("Pick"), n=3,
                                                 temperature=1.0, seed=7, max_tokens=6)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in reply.choices]
    texts = ["", "", ""]
    async for chunk in await client.chat.completions.create(
            model="chat", messages=user("Pick"), n=3, temperature=1.0, seed=7, max_tokens=6,
            stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


async def test_models_list_names_the_chat_graph(client: openai.AsyncOpenAI) -> None:
    assert {"chat", "dialogue"} <= {m.id async for m in client.models.list()}


async def test_an_unknown_model_is_a_404_naming_the_models_served(
        client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="gpt-4o", messages=user("Hi"))
    assert "gpt-4o" in caught.value.message and "chat" in caught.value.message
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(("fields", "named"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"seed": "seven"}, "seed"),
])
async def test_a_field_not_served_or_out_of_range_is_a_400_naming_it(
        client: openai.AsyncOpenAI, fields: dict, named: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="chat", messages=user("Hi"), **fields)
    assert caught.value.body["param"] == named and named in caught.value.message


async def test_a_remote_image_url_is_refused_without_the_flag(client: openai.AsyncOpenAI) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="chat",
                                             messages=[{"role": "user", "content": content}])
    assert "--allow-remote-media" in caught.value.message


async def test_the_async_client_on_trio_with_requests_in_parallel() -> None:
    """The client's own HTTP stack on trio, over a loopback connection."""
    prompts = ["Hi!", "Hello there, how are you?", "Tell me a story"]
    async with listening(DIALOGUE) as server, server.openai() as client:
        alone = [(await client.chat.completions.create(
            model="chat", messages=user(p), **GREEDY)).choices[0].message.content
            for p in prompts]
        streamed: dict[int, str] = {}

        async def stream(i: int) -> None:
            chunks = await client.chat.completions.create(
                model="chat", messages=user(prompts[i]), stream=True, **GREEDY)
            streamed[i] = "".join([c.choices[0].delta.content or "" async for c in chunks
                                   if c.choices])

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(stream, i)
    assert [streamed[i] for i in range(len(prompts))] == alone


async def test_a_stop_string_ends_the_reply_before_it(client: openai.AsyncOpenAI) -> None:
    free = await client.chat.completions.create(model="chat", messages=user("Go on"),
                                                temperature=0, max_tokens=24)
    text = free.choices[0].message.content
    stop = next((c for c in text[2:] if c.isascii() and c.isprintable()), None)
    assert stop is not None, f"no ASCII character to stop at in {text!r}"
    kept = text[:text.index(stop)]
    whole = await client.chat.completions.create(model="chat", messages=user("Go on"),
                                                 temperature=0, max_tokens=24, stop=[stop])
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (kept, "stop")
    chunks = await client.chat.completions.create(model="chat", messages=user("Go on"),
                                                  temperature=0, max_tokens=24, stop=stop,
                                                  stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == kept


async def test_a_json_schema_response_format_constrains_the_reply(
        client: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    # The tiny model's byte tokenizer: token = byte + 3. Whitespace is what the grammar allows
    # between any two JSON tokens and what a random model then picks forever; bias it out.
    no_space = {str(ord(c) + 3): -100 for c in " \t\r\n"}
    reply = await client.chat.completions.create(
        model="chat", messages=user("JSON please"), temperature=0, max_tokens=64,
        logit_bias=no_space, response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop", repr(reply.choices[0].message.content)
    assert set(json.loads(reply.choices[0].message.content)) == {"ok"}


async def test_the_api_description_shows_the_chat_body() -> None:
    async with served(DIALOGUE) as app, app.http() as http:
        api = (await http.get("/openapi.json")).json()
        assert (await http.get("/docs")).status_code == 200
    body = api["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert {"model", "messages", "stream", "modalities", "seed"} <= set(schema["properties"])
    assert "$ref" not in json.dumps(schema)


PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "member": {"type": "boolean"}}}


async def test_compact_json_whitespace_gives_valid_json_over_seeds() -> None:
    """``--json-whitespace compact``: the tiny random model writes an object of the schema
    greedily, and sampling (temperature 1) in at least 9 of 10 seeds. 128 tokens hold the
    longest such object (the byte tokenizer: ~105 bytes); with any whitespace, blanks could
    fill them. The eleven requests go at once (the engine decodes them in one batch)."""
    async with served(DIALOGUE, chat=ChatPolicy(json_whitespace="compact")) as app, \
            app.openai() as client:

        async def person(temperature: float, seed: int | None) -> dict | None:
            reply = await client.chat.completions.create(
                model="chat", messages=user("Describe a person as JSON"),
                temperature=temperature, seed=seed, max_tokens=128,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON}})
            try:
                return json.loads(reply.choices[0].message.content)
            except json.JSONDecodeError:
                return None

        people: dict[int | None, dict | None] = {}

        async def ask(seed: int | None) -> None:
            people[seed] = await person(0 if seed is None else 1.0, seed)

        async with trio.open_nursery() as nursery:
            for seed in (None, *range(10)):
                nursery.start_soon(ask, seed)
        greedy, sampled = people[None], [people[seed] for seed in range(10)]
    assert greedy is not None and set(greedy) == set(PERSON["properties"]), greedy
    valid = [p for p in sampled if p is not None]
    assert len(valid) >= 9 and all(set(p) == set(PERSON["properties"]) for p in valid), sampled
