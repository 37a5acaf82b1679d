"""No client learns another's prompts through the KV cache: each API key is a tenant whose
cache is its own, a request's ``cache_salt`` scopes it further, and a tenant still reuses its
own turns. In process: the dialogue example's graphs (tiny model) behind `build_app`, driven
by the official ``openai`` client and httpx through the ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

import omni
from cli._load import load_module
from omni.serve import GuardState, build_app
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
            refused = await http.post("/v1/graphs/dialogue", headers={
                "authorization": "Bearer key-of-bob"}, json={"inputs": {
                    "session": "s", "text": "x", "salt": "alice's"}})
            assert refused.status_code == 400 and "is the server's" in refused.text
            assert (await turn("key-of-alice", "x", cache_salt=5)).status_code == 400
            assert (await turn("nobody", "x")).status_code == 401
