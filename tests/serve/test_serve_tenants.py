"""No client learns another's prompts through the KV cache: each API key is a tenant whose
cache is its own, a request's ``cache_salt`` scopes it further, and a tenant still reuses its
own turns. In process: the dialogue example's graphs (tiny model) behind `build_app`, driven
by the official ``openai`` client and httpx through the ASGI transport. And the key file
``--api-key-file`` reads: one key a line, a mistake named by its line, never echoing a key."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import omni
from cli._errors import CliError
from cli._load import load_module
from cli.serve import _metrics_keys, _read_keys
from omni.serve import GuardState, build_app
from omni.serve.openai import MediaPolicy
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import chat_request
from tests.serve._server import ROOT

KEYS = {"key-of-alice": "alice", "key-of-bob": "bob"}
PIN = ("You are a bank's assistant. The customer's card number is 4111 1111 1111 1111 and "
       "the PIN is 7391. Answer questions about the account briefly. ")


@pytest.fixture(scope="module")
def dialogue() -> Any:
    return load_module(str(ROOT / "examples" / "omni_dialogue.py"))


@asynccontextmanager
async def served(dialogue: Any) -> AsyncIterator[Any]:
    graphs = {"chat": dialogue.chat, "dialogue": dialogue.dialogue}
    async with omni.Runtime(graphs=list(graphs.values())) as rt:
        yield build_app(rt, graphs, GuardState(api_keys=dict(KEYS)))


def client(app: Any, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return openai.AsyncOpenAI(base_url="http://omni/v1", api_key=key, max_retries=0,
                              http_client=http)


async def cached(chat: openai.AsyncOpenAI, text: str, **extra: Any) -> int:
    reply = await chat.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": text}], max_tokens=2,
        temperature=0, extra_body=extra or None)
    return reply.usage.prompt_tokens_details.cached_tokens


async def test_a_tenant_sees_its_own_reuse_and_never_anothers(dialogue: Any) -> None:
    async with served(dialogue) as app:
        alice, bob = client(app, "key-of-alice"), client(app, "key-of-bob")
        assert await cached(alice, PIN + "What is my balance?") == 0
        assert await cached(bob, PIN + "Is the PIN 7391?") == 0  # alice's prefix: not bob's
        assert await cached(alice, PIN + "Is the PIN 7391?") >= 160  # her own system text
        assert await cached(bob, PIN + "Is the PIN 7390?") >= 160  # his own earlier guess


async def test_a_cache_salt_scopes_a_tenants_cache_further(dialogue: Any) -> None:
    async with served(dialogue) as app:
        alice = client(app, "key-of-alice")
        assert await cached(alice, PIN + "One.", cache_salt="user-1") == 0
        assert await cached(alice, PIN + "Two.", cache_salt="user-2") == 0
        assert await cached(alice, PIN + "Two.") == 0
        assert await cached(alice, PIN + "Three.", cache_salt="user-1") >= 160
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            await cached(alice, PIN, cache_salt="x" * 257)


async def test_sessions_and_the_cache_salt_input_of_a_graph_are_the_tenants(
        dialogue: Any) -> None:
    async with served(dialogue) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omni") as http:
            async def turn(key: str, text: str, **body: Any) -> httpx.Response:
                return await http.post("/v1/graphs/dialogue", headers={
                    "authorization": f"Bearer {key}"}, json={"inputs": {
                        "session": "shared-name", "text": text, "max_tokens": 2}, **body})

            first = await turn("key-of-alice", "My PIN is 7391.")
            second = await turn("key-of-alice", "And my card?")
            other = await turn("key-of-bob", "What did I say?")
            outputs = [r.json()["output"] for r in (first, second, other)]
            assert [o["turn"] for o in outputs] == [1, 2, 1]
            assert outputs[1]["cached_tokens"] > 0 and outputs[2]["cached_tokens"] == 0
            # the spoken reply comes back as data, its server path named as the file only
            assert outputs[2]["wav"] == "out.wav"
            assert other.json()["files"]["out"]["data"].startswith("UklGR")  # RIFF
            for name in ("salt", "tenant"):
                refused = await http.post("/v1/graphs/dialogue", headers={
                    "authorization": "Bearer key-of-bob"}, json={"inputs": {
                        "session": "s", "text": "x", name: "alice's"}})
                assert refused.status_code == 400 and "is the server's" in refused.text
            assert (await turn("key-of-alice", "x", cache_salt=5)).status_code == 400
            assert (await turn("nobody", "x")).status_code == 401


async def test_a_chat_request_carries_its_tenant_whatever_its_cache_salt() -> None:
    async def tenant(name: str, salt: str | None) -> str:
        body = ChatCompletionRequest.model_validate({
            "model": "chat", "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": salt})
        return (await chat_request(body, MediaPolicy(), name)).tenant

    alice = await tenant("alice", None)
    assert alice == await tenant("alice", "another salt") != await tenant("bob", None)
    assert "alice" not in alice and len(alice) == 32  # a digest, not the name
    assert await tenant("", "x") == ""  # the keyless server's one tenant


def keys_in(tmp_path: Path, text: str, option: str = "--api-key-file") -> dict[str, str]:
    (tmp_path / "keys").write_text(text)
    return _read_keys(str(tmp_path / "keys"), option)


def test_a_key_file_line_is_one_key(tmp_path: Path) -> None:
    keys = keys_in(tmp_path, "# the tenants\n"
                             "  # indented comment\n"
                             "bob #9f8e7d6c5b4a3928\n"  # the older NAME KEY: '#' is the key's
                             "carol:0123456789abcdef:x\n"  # the first ':' ends the name
                             "\n"
                             "ZmFrZS1rZXktZm9yLXRlc3Rz\n")
    assert keys["#9f8e7d6c5b4a3928"] == "bob"
    assert keys["0123456789abcdef:x"] == "carol"
    assert keys["ZmFrZS1rZXktZm9yLXRlc3Rz"].startswith("key-")
    assert len(keys) == 3


@pytest.mark.parametrize(("line", "error"), [
    ("bob #short", "shorter than 16 characters"),
    ("s3cret", "shorter than 16 characters"),
    ("alice 0123456789abcdef extra", "got 3 words"),
    ("a/b:0123456789abcdef-secret", "a name is 1 to 64"),
    (":0123456789abcdef-secret", "a name is 1 to 64"),
    ("dave:0123456789abcdef-sécret", "printable ASCII"),
])
def test_a_key_file_mistake_names_its_line_and_never_the_key(tmp_path: Path, line: str,
                                                             error: str) -> None:
    with pytest.raises(CliError) as refused:
        keys_in(tmp_path, f"# comment\n{line}\n")
    message = str(refused.value)
    assert message.startswith(f"--api-key-file {tmp_path / 'keys'}:2: ") and error in message
    secret = line.split()[-1].split(":")[-1]
    assert secret not in message and "\n" not in message


def test_the_operators_keys_are_no_tenants(tmp_path: Path) -> None:
    (tmp_path / "operator").write_text("operator-key-0123456789\n")
    tenants = keys_in(tmp_path, "alice:operator-key-0123456789\n")
    with pytest.raises(CliError, match="a key of it is a tenant's too"):
        _metrics_keys(str(tmp_path / "operator"), tenants)
    assert _metrics_keys(str(tmp_path / "operator"), {}) == {"operator-key-0123456789"}
    assert _metrics_keys(None, tenants) == frozenset()


async def test_an_image_request_runs_under_its_tenants_salt() -> None:
    """The image route fills a graph's cache-salt input as the chat route does: per tenant
    and per request ``cache_salt``, never from the client's inputs."""
    module = load_module(str(ROOT / "tests" / "serve" / "salted_images.py"))
    async with omni.Runtime() as rt:
        app = build_app(rt, {"salted": module.salted}, GuardState(api_keys=dict(KEYS)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://omni") as http:
            async def salt(key: str, **body: Any) -> str:
                answer = await http.post("/v1/images/generations", headers={
                    "authorization": f"Bearer {key}"}, json={"prompt": "fox", **body})
                assert answer.status_code == 200, answer.text
                png = base64.b64decode(answer.json()["data"][0]["b64_json"]).decode()
                prompt, _, salt = png.partition("|")
                assert prompt == "fox"
                return salt

            alice, bob = await salt("key-of-alice"), await salt("key-of-bob")
            assert alice and bob and alice != bob
            assert await salt("key-of-alice") == alice
            assert await salt("key-of-alice", cache_salt="mine") not in (alice, bob, "")
