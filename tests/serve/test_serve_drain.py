"""The drain of `omni.serve.serve` once stopped (what SIGTERM starts in ``omni serve``;
tests/reliability/test_serve_drain.py sends the real signal to the real command), in
process on a loopback port, seen by raw HTTP clients and by the official ``openai`` client.

Asserted: streams that outlive the drain timeout end with an ``error`` event (OpenAI's error
object, code ``server_shutdown``) and are counted as cut; during the drain a new request gets
503 with ``Retry-After`` (the listener stays open to say so) and ``Connection: close``; an idle
keep-alive connection is closed when the drain starts, and a pooled one does not keep the
server past the last request in flight. Each test waits for conditions (files a node writes,
a closed socket, the server's return), never for a length of time.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import trio

from cli.serve import _drained
from tests._wait import wait_until
from tests.serve._inproc import Listening, listening
from tests.serve._server import STOP_CAP_S, idle_connection

GRAPHS = Path(__file__).with_name("drain_graphs.py")


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file drain_graphs.py's nodes wait for and note their start beside."""
    monkeypatch.setenv("OMNI_TEST_GATE", str(tmp_path / "open"))
    return tmp_path / "open"


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


async def test_streams_longer_than_the_drain_timeout_end_with_an_error_event_and_are_counted_cut(
        gate: Path) -> None:
    # the gate is never opened: the streams run until they are cut
    results: dict[str, object] = {}
    async with listening(GRAPHS, drain_timeout=1) as server, server.http() as http, \
            server.openai() as client:

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
            server.stop.set()
        with trio.fail_after(STOP_CAP_S):
            await server.stopped.wait()
    assert (server.state.num_finished, server.state.num_cut) == (0, 2)
    assert _drained(server.state, 1) == ("0 request(s) in flight finished, 2 cut at the drain "
                                         "timeout (1 s)")
    *items, last = events(results["raw"])
    assert [data for _, data in items] == [json.dumps({"output": "output", "item": f"raw-{i}"})
                                           for i in range(len(items))]
    assert last[0] == "error"
    error = json.loads(last[1])["error"]
    assert error["code"] == "server_shutdown" and "drain timeout" in error["message"]
    words, failure = results["chat"]
    assert words and set(words) == {"word "}
    assert isinstance(failure, openai.APIError) and failure.code == "server_shutdown"


async def test_a_drain_refuses_new_requests_closes_idle_connections_and_ends_with_its_work(
        gate: Path) -> None:
    answer: list[str] = []
    # a timeout no run reaches: the server must end with its last request, not the timeout
    async with listening(GRAPHS, drain_timeout=10 * STOP_CAP_S) as server:
        idle = await idle_connection(server.url)
        async with server.http() as pool:
            assert (await pool.get("/v1/models")).status_code == 200  # a pooled connection

            async def held() -> None:
                answer.extend(await stream_lines(pool, "waiting", "held"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(held)
                await wait_until((gate.parent / "started-held").exists, "the request to start")
                server.stop.set()
                with trio.fail_after(STOP_CAP_S):  # closed by the drain, not by its end
                    assert await idle.receive_some() == b""
                await _refused_while_draining(server, gate)
                gate.touch()
            # the pooled client is still open: its connection must not hold the server
            with trio.fail_after(STOP_CAP_S):
                await server.stopped.wait()
    assert (server.state.num_finished, server.state.num_cut) == (1, 0)
    data = [d for _, d in events(answer)]
    assert data == [json.dumps({"output": "output", "item": "before"}),
                    json.dumps({"output": "output", "item": "after"}), "[DONE]"]


async def _refused_while_draining(server: Listening, gate: Path) -> None:
    """A new connection's request gets 503 + Retry-After + Connection: close, with raw httpx
    and with the official client; /health says draining."""
    async with server.http() as http:
        refused = await http.post("/v1/graphs/forever", json={"inputs": {"text": "late"}})
        health = await http.get("/health")
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "server_shutdown"
    assert (health.status_code, health.json()) == (503, {"status": "draining", "in_flight": 1})
    async with server.openai() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.models.retrieve("talk")
    assert caught.value.status_code == 503 and caught.value.code == "server_shutdown"
    assert not (gate.parent / "started-late").exists()  # never reached the graph


async def test_a_flood_ignoring_retry_after_cuts_nothing_and_cannot_hold_the_drain_open(
        gate: Path) -> None:
    """Clients that send again at once when refused (16, each on new connections, as fast as
    the server answers) get 503s; the requests in flight finish, and the server ends with
    its last one."""
    answers: list[httpx.Response] = []
    refused: list[int] = []
    async with listening(GRAPHS, drain_timeout=10 * STOP_CAP_S) as server, \
            server.http() as pool:

        async def held(i: int) -> None:
            answers.append(await pool.post("/v1/graphs/waiting",
                                           json={"inputs": {"text": f"held-{i}"}}))

        async def flood() -> None:
            while not server.stopped.is_set():
                try:
                    async with server.http() as http:
                        answer = await http.post("/v1/graphs/forever",
                                                 json={"inputs": {"text": "again"}})
                    refused.append(answer.status_code)
                except httpx.TransportError:  # the server left between two requests
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(held, i)
            await wait_until(lambda: all((gate.parent / f"started-held-{i}").exists()
                                         for i in range(4)), "the requests to start")
            server.stop.set()
            for _ in range(16):
                nursery.start_soon(flood)
            await wait_until(lambda: len(refused) >= 64, "the flood to be refused")
            gate.touch()
            with trio.fail_after(STOP_CAP_S):
                await server.stopped.wait()
    assert (server.state.num_finished, server.state.num_cut) == (4, 0)
    assert [a.json() for a in answers] == [{"output": ["before", "after"]}] * 4
    assert set(refused) == {503}


async def test_a_stream_ending_during_the_drain_closes_its_connection_at_once(
        gate: Path) -> None:
    """A keep-alive connection whose stream began before the drain carries no ``Connection:
    close``; it is closed as the stream's last event goes, while other requests still hold
    the drain, so that a client's next request on it fails at once (and goes elsewhere)
    instead of waiting for the drain's end."""
    async with listening(GRAPHS, drain_timeout=10 * STOP_CAP_S) as server, \
            server.http() as other:
        where = urlsplit(server.url)
        connection = await trio.open_tcp_stream(where.hostname, where.port)
        body = json.dumps({"inputs": {"text": "kept"}, "stream": True}).encode()
        await connection.send_all(
            b"POST /v1/graphs/waiting HTTP/1.1\r\nHost: omni\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

        async def endless() -> None:  # holds the drain open until the test ends
            await stream_lines(other, "forever", "holding")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(endless)
            await wait_until(lambda: all((gate.parent / f"started-{name}").exists()
                                         for name in ("kept", "holding")), "both to start")
            server.stop.set()
            gate.touch()
            received = b""
            with trio.fail_after(STOP_CAP_S):
                while not received.endswith(b"\r\n0\r\n\r\n"):  # the stream's last chunk
                    received += await connection.receive_some()
                assert await connection.receive_some() == b""  # closed, not kept deaf
            assert b"data: [DONE]" in received and not server.stopped.is_set()
            nursery.cancel_scope.cancel()
