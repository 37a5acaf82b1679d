"""SIGTERM to a real ``omni serve`` process: the drain, seen by raw HTTP clients and by the
official ``openai`` client.

Asserted: streams that outlive ``--drain-timeout`` end with an ``error`` event (OpenAI's error
object, code ``server_shutdown``) and the exit line counts them as cut; during the drain a new
request gets 503 with ``Retry-After`` (the listener stays open to say so) and ``Connection:
close``; an idle keep-alive connection is closed when the drain starts, and a pooled one does
not keep the process past the last request in flight. Each test waits for conditions (files a
node writes, a closed socket, the process's exit), never for a length of time.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests._wait import wait_until
from tests.serve._server import STOP_CAP_S, Server, idle_connection, running

GRAPHS = Path(__file__).with_name("drain_graphs.py")


def events(lines: list[str]) -> list[tuple[str | None, str]]:
    """A server-sent event stream's lines as (event name, data) pairs."""
    found, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            found.append((name, line.removeprefix("data: ")))
            name = None
    return found


async def stream_lines(http: httpx.AsyncClient, graph: str, text: str) -> list[str]:
    """Every line of a streamed request to `graph`, to the end of its response."""
    async with http.stream("POST", f"/v1/graphs/{graph}",
                           json={"inputs": {"text": text}, "stream": True}) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines()]


def test_streams_longer_than_the_drain_timeout_end_with_an_error_event_and_are_counted_cut(
        tmp_path: Path) -> None:
    gate = tmp_path / "open"  # never opened: the streams run until they are cut
    with running(GRAPHS, "--drain-timeout", "1", env={"OMNI_TEST_GATE": str(gate)}) as server:
        raw, chat = trio.run(_cut_streams, server, gate)
        assert server.process.returncode == 0, server.stderr()
        assert ("stopped (SIGTERM); 0 request(s) in flight finished, 2 cut at the drain "
                "timeout (1 s)") in server.stderr()
    *items, last = events(raw)
    assert [data for _, data in items] == [json.dumps({"output": "output", "item": f"raw-{i}"})
                                           for i in range(len(items))]
    assert last[0] == "error"
    error = json.loads(last[1])["error"]
    assert error["code"] == "server_shutdown" and "drain timeout" in error["message"]
    words, failure = chat
    assert words and set(words) == {"word "}
    assert isinstance(failure, openai.APIError) and failure.code == "server_shutdown"


async def _cut_streams(server: Server, gate: Path) -> tuple[list[str], tuple]:
    results: dict[str, object] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
            openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                               max_retries=0, timeout=60) as client:

        async def raw() -> None:
            results["raw"] = await stream_lines(http, "forever", "raw")

        async def chat() -> None:
            words: list[str] = []
            try:
                chunks = await client.chat.completions.create(
                    model="talk", messages=[{"role": "user", "content": "oai"}], stream=True)
                async for chunk in chunks:
                    words += [c.delta.content for c in chunk.choices if c.delta.content]
            except openai.APIError as exc:
                results["chat"] = (words, exc)
            else:
                results["chat"] = (words, None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(raw)
            nursery.start_soon(chat)
            await wait_until(lambda: all((gate.parent / f"started-{name}").exists()
                                         for name in ("raw", "oai")), "both streams to start")
            server.process.send_signal(signal.SIGTERM)
    await trio.to_thread.run_sync(server.wait)
    return results["raw"], results["chat"]


def test_a_drain_refuses_new_requests_closes_idle_connections_and_ends_with_its_work(
        tmp_path: Path) -> None:
    gate = tmp_path / "open"
    # a timeout no run reaches: the process must end with its last request, not the timeout
    with running(GRAPHS, "--drain-timeout", str(10 * STOP_CAP_S),
                 env={"OMNI_TEST_GATE": str(gate)}) as server:
        lines = trio.run(_drain_with_idle_connections, server, gate)
        assert server.process.returncode == 0, server.stderr()
        assert "stopped (SIGTERM); every request in flight finished (1), none cut" in \
            server.stderr()
    data = [d for _, d in events(lines)]
    assert data == [json.dumps({"output": "output", "item": "before"}),
                    json.dumps({"output": "output", "item": "after"}), "[DONE]"]


async def _drain_with_idle_connections(server: Server, gate: Path) -> list[str]:
    idle = await idle_connection(server.url)
    answer: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as pool:
        assert (await pool.get("/v1/models")).status_code == 200  # a pooled connection

        async def held() -> None:
            answer.extend(await stream_lines(pool, "waiting", "held"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(held)
            await wait_until((gate.parent / "started-held").exists, "the request to start")
            server.process.send_signal(signal.SIGTERM)
            with trio.fail_after(STOP_CAP_S):  # closed by the drain, not by its end
                assert await idle.receive_some() == b""
            await _refused_while_draining(server.url, gate)
            gate.touch()
        # the pooled client is still open: its connection must not hold the process
        assert await trio.to_thread.run_sync(server.wait) is not None, "still running"
    return answer


async def _refused_while_draining(url: str, gate: Path) -> None:
    """A new connection's request gets 503 + Retry-After + Connection: close, with raw httpx
    and with the official client; /health says draining."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        refused = await http.post("/v1/graphs/forever", json={"inputs": {"text": "late"}})
        health = await http.get("/health")
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "server_shutdown"
    assert (health.status_code, health.json()) == (503, {"status": "draining", "in_flight": 1})
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.models.retrieve("talk")
    assert caught.value.status_code == 503 and caught.value.code == "server_shutdown"
    assert not (gate.parent / "started-late").exists()  # never reached the graph
