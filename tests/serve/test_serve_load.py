"""`examples/omni_dialogue.py` served under chat load, as a client and an operator see it, in
process on a loopback port (the connection is the behaviour): a client dropping its stream
mid-reply cancels the reply (seen in /metrics: the call ends failed, nothing stays in flight
or pinned), and stopping the server during load drains the requests in flight and leaves
none of the runtime's shared memory behind. (SIGTERM to the real command, and its exit
status: tests/reliability/test_serve_drain.py.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests._wait import wait_until
from tests.serve._inproc import listening
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
LONG = 4000  # tokens: a reply still being written when its client goes away
# Greedy: a sampled reply of the tiny random model could end at EOS after a token or two
# (fresh-clone CI once saw a stream of one chunk); greedy replies are the same every run.
GREEDY = {"temperature": 0}


async def metric(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
    text = (await http.get("/metrics")).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def until(http: httpx.AsyncClient, read, check, what: str) -> None:
    """Return once `check(await read())` holds (the server's own view, polled); fail after a
    cap no passing run comes near, naming `what`."""
    async def holds() -> bool:
        return check(await read())

    await wait_until(holds, what)


async def test_a_client_dropping_its_stream_cancels_the_reply() -> None:
    async with listening(DIALOGUE) as server, server.http() as http, \
            server.openai() as client:
        before = await metric(http, "omni_replica_calls_total", node="Chat", outcome="failed")
        stream = await client.chat.completions.create(
            model="chat", max_tokens=LONG, stream=True, **GREEDY,
            messages=[{"role": "user", "content": "Tell me a long story."}])
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 3:
                break
        await stream.close()  # the connection goes: the server must stop writing the reply
        assert chunks == 3
        await until(http, lambda: metric(http, "omni_replica_calls_total", node="Chat",
                                         outcome="failed"), lambda n: n == before + 1,
                    "the dropped reply's call to end as failed (cancelled)")
        assert await metric(http, "omni_replica_in_flight", node="Chat") == 0
        assert await metric(http, "omni_kv_pinned_pages") == 0
        assert await metric(http, "omni_replica_calls_total", node="Chat", outcome="ok") == 0
        reply = await client.chat.completions.create(  # the server goes on
            model="chat", max_tokens=4, **GREEDY, messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason == "length"


async def test_a_stop_under_load_drains_then_leaves_no_shared_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("OMNI_SHM_DIR", str(shm))
    results: list[object] = []
    async with listening(DIALOGUE) as server, server.openai() as client:
        await client.chat.completions.create(model="chat", max_tokens=4, **GREEDY,
                                             messages=[{"role": "user", "content": "warm up"}])
        assert any(shm.iterdir()), "the runtime's KV store lives in OMNI_SHM_DIR"

        async def one(i: int) -> None:
            try:
                reply = await client.chat.completions.create(
                    model="chat", max_tokens=64, **GREEDY,
                    messages=[{"role": "user", "content": f"Question {i}"}])
                results.append(reply.choices[0].finish_reason)
            except Exception as exc:  # what a client would see: asserted below
                results.append(exc)

        async with server.http() as http, trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
            await until(http, lambda: metric(http, "omni_replica_in_flight", node="Chat"),
                        lambda n: n > 0, "requests in flight")
            server.stop.set()
        with trio.fail_after(120):
            await server.stopped.wait()
        assert server.state.num_cut == 0 and server.state.num_finished >= 1, server.state
    # a request the server took before the stop finished whole; one that came after was
    # refused (503)
    finished = [r for r in results if isinstance(r, str)]  # "length" or "stop"
    assert len(results) == 8 and finished, results
    for r in results:
        assert r in ("length", "stop") or isinstance(r, openai.APIConnectionError) or (
            isinstance(r, openai.APIStatusError) and r.status_code == 503), r
    assert list(shm.iterdir()) == []  # arenas, lease tables: all gone
