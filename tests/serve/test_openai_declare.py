"""The OpenAI marks on graphs and the chat body's checks, in process (no server). That the
marks import no torch is checked in a fresh interpreter with the other light entry points:
tests/test_layering.py."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest
import trio

import omni
from cli._load import load_module, select_graph
from omni.serve import ApiError
from omni.serve.openai import (
    CHAT_COMPLETIONS,
    IMAGE_GENERATIONS,
    MediaPolicy,
    chat_completions,
    endpoint_of,
    image_generations,
)
from omni.serve.openai._body import validated
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import ChatPolicy, chat_request
from omni.serve.openai._media import decode_audio


@omni.node
async def echo(request: object) -> str:
    return str(request)


def test_a_mark_returns_the_graph_it_marks() -> None:
    @omni.graph
    def talk(request: object):
        return echo(request)

    assert endpoint_of(talk) is None
    assert chat_completions(talk) is talk and endpoint_of(talk) == CHAT_COMPLETIONS


def test_a_mark_refuses_what_is_not_a_graph_and_a_graph_without_its_inputs() -> None:
    with pytest.raises(TypeError, match=r"above @omni\.graph"):
        chat_completions(echo)

    @omni.graph
    def draw(prompt: str):
        return echo(prompt)

    with pytest.raises(TypeError, match="lacks out, width, height, seed, png"):
        image_generations(draw)
    assert endpoint_of(draw) is None and IMAGE_GENERATIONS == "images.generations"


def test_omni_run_picks_the_plain_graph_of_a_file_that_also_has_an_endpoint(tmp_path) -> None:
    path = tmp_path / "two.py"
    path.write_text(
        "import omni\nfrom omni.serve.openai import chat_completions\n\n"
        "@omni.node\nasync def echo(request: object) -> str:\n    return str(request)\n\n"
        "@omni.graph\ndef plain(request: object):\n    return echo(request)\n\n"
        "@chat_completions\n@omni.graph\ndef chat(request: object):\n"
        "    return echo(request)\n")
    module = load_module(str(path))
    assert select_graph(module, None, str(path)).name == "plain"
    assert select_graph(module, "chat", str(path)).name == "chat"


def chat_body(**fields: object) -> ChatCompletionRequest:
    body = {"model": "chat", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return validated(ChatCompletionRequest, body, "chat completions")


def sampling_params(body: ChatCompletionRequest, policy: ChatPolicy | None = None) -> object:
    """The `SamplingParams` the chat endpoint hands its graph for `body`."""
    return trio.run(chat_request, body, MediaPolicy(), "", policy or ChatPolicy()).params


def test_openai_fields_become_sampling_params() -> None:
    params = sampling_params(chat_body(seed=7, max_tokens=5, max_completion_tokens=9,
                                       stop="\n", n=2, temperature=0.5, top_p=0.9,
                                       presence_penalty=1.0, logit_bias={"5": -100}))
    assert (params.sampling_seed, params.max_new_tokens, params.stop, params.n) == (
        7, 9, ("\n",), 2)
    assert (params.temperature, params.top_p, params.presence_penalty) == (0.5, 0.9, 1.0)
    assert dict(params.logit_bias) == {"5": -100.0}
    assert sampling_params(chat_body()).max_new_tokens == 128
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_schema = sampling_params(chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}))
    assert json.loads(as_schema.json_schema) == schema
    as_object = sampling_params(chat_body(response_format={"type": "json_object"}))
    assert json.loads(as_object.json_schema) == {"type": "object"}


def test_compact_json_whitespace_sends_the_schema_as_its_grammar_without_blanks() -> None:
    """--json-whitespace compact: the schema reaches the graph as the EBNF it compiles to,
    with no free whitespace; a schema that does not compile is the client's 400."""
    from omni.compute.grammar import json_schema_ebnf

    compact = ChatPolicy(json_whitespace="compact")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = sampling_params(chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}), compact)
    assert params.json_schema is None
    assert params.ebnf == json_schema_ebnf(json.dumps(schema), any_whitespace=False)
    blanks = "[ \\n\\r\\t]*"  # what the default grammar allows between tokens

    def root(grammar: str) -> str:
        return next(line for line in grammar.splitlines() if line.startswith("root ::="))

    assert blanks in root(json_schema_ebnf(json.dumps(schema)))
    assert blanks not in root(params.ebnf)
    assert sampling_params(chat_body(), compact).ebnf is None
    with pytest.raises(ApiError) as caught:
        sampling_params(chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "integer", "multipleOf": 2}}}), compact)
    assert (caught.value.status, caught.value.param) == (400, "response_format")
    assert "multipleOf" in caught.value.message
    with pytest.raises(ValueError, match="'any' or 'compact'"):
        ChatPolicy(json_whitespace="tight")  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"seed": 2**70}, "seed", "seed must be in"),
    ({"max_completion_tokens": -1}, "max_tokens", "max_tokens must be >= 0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"messages": [{"role": "user", "content": "x", "name": "bo"}]}, "messages.0.name",
     "not supported"),
])
def test_a_refusal_names_the_field(fields: dict, param: str, says: str) -> None:
    with pytest.raises(ApiError) as caught:
        sampling_params(chat_body(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert says in caught.value.message


def test_fields_that_ask_for_nothing_pass() -> None:
    assert chat_body(logprobs=False, tools=None).model == "chat"


def wav(samples: np.ndarray, rate: int, channels: int) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()


async def test_audio_is_decoded_to_mono_float_samples() -> None:
    frames = np.array([[0.5, -0.5], [0.25, 0.25]], dtype=np.float32)
    stereo = np.tile(frames, (101, 1)).reshape(-1)  # 202 frames: a clip long enough
    part = await decode_audio(wav(stereo, 8000, 2), "wav", "m", MediaPolicy())
    assert part.sample_rate == 8000
    np.testing.assert_allclose(part.samples, np.tile([0.0, 0.25], 101), atol=1e-4)


@pytest.mark.parametrize(("data", "fmt", "says"), [
    ("UklGR", "mp3", "only 'wav'"), ("not base64!", "wav", "not valid base64"),
    (base64.b64encode(b"RIFF....").decode(), "wav", "not a PCM WAV file")])
async def test_bad_audio_is_a_400(data: str, fmt: str, says: str) -> None:
    with pytest.raises(ApiError, match=says) as caught:
        await decode_audio(data, fmt, "messages.0.content.0.input_audio", MediaPolicy())
    assert caught.value.status == 400
