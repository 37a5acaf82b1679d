"""SIGTERM to `omni serve` under mixed traffic: streams and plain requests that finish during
the drain, streams that outlive `--drain-timeout`, and idle keep-alive connections. Every
client learns how its request ended (a complete answer, or an error event / 503 with code
`server_shutdown`, never a cut connection), and the exit line's counts are what the clients
saw. Race-free: the counts are compared with the clients' own outcomes, whichever side of the
timeout a request fell on."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests._wait import wait_until
from tests.serve._server import ROOT, idle_connection, running

GRAPHS = ROOT / "tests" / "serve" / "drain_graphs.py"
STREAMS, REQUESTS, ENDLESS, IDLE = 3, 2, 3, 2  # gated streams, gated JSON requests, ...
TIMEOUT_S = 2  # either side of it is asserted: the clients' outcomes are the counts


@pytest.mark.proc  # a real SIGTERM to the real command, its exit status and its last line
def test_sigterm_under_traffic_tells_every_client_and_counts_what_it_cut(tmp_path, record):
    gate = tmp_path / "open"
    with running(GRAPHS, "--drain-timeout", str(TIMEOUT_S),
                 env={"OMNI_TEST_GATE": str(gate)}) as server:
        outcomes = trio.run(_traffic, server, gate)
        assert server.process.returncode == 0, server.stderr()
        said = re.search(r"stopped \(SIGTERM\); (.*)$", server.stderr(), flags=re.M)
    assert said, server.stderr()
    finished = sum(o == "finished" for o in outcomes.values())
    cut = sum(o == "cut" for o in outcomes.values())
    assert finished + cut == len(outcomes) == STREAMS + REQUESTS + ENDLESS + 1, outcomes
    assert all(outcomes[f"endless-{i}"] == "cut" for i in range(ENDLESS))
    assert outcomes["chat"] == "cut"
    assert said[1] == (f"{finished} request(s) in flight finished, {cut} cut at the drain "
                       f"timeout ({TIMEOUT_S} s)"), said[1]
    record("proc.serve_drained", tries=len(outcomes),
           outcome=f"{finished} requests finished during the drain and {cut} were cut at "
                   f"--drain-timeout {TIMEOUT_S} s (each stream's last event an error event, "
                   f"code server_shutdown; the official client raised APIError), as the exit "
                   f"line counted; {IDLE} idle keep-alive connections closed when the drain "
                   f"began; no connection cut short; exit 0")


async def _traffic(server, gate: Path) -> dict[str, str]:
    """Start every request, SIGTERM once all run, open the gate once the drain began; each
    request's outcome: "finished" or "cut"."""
    outcomes: dict[str, str] = {}
    idle = [await idle_connection(server.url) for _ in range(IDLE)]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
            openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                               max_retries=0, timeout=60) as client:
        async with trio.open_nursery() as nursery:
            for i in range(STREAMS):
                nursery.start_soon(_gated_stream, http, f"stream-{i}", outcomes)
            for i in range(REQUESTS):
                nursery.start_soon(_gated_request, http, f"request-{i}", outcomes)
            for i in range(ENDLESS):
                nursery.start_soon(_endless_stream, http, f"endless-{i}", outcomes)
            nursery.start_soon(_chat, client, outcomes)
            names = [*(f"stream-{i}" for i in range(STREAMS)),
                     *(f"request-{i}" for i in range(REQUESTS)),
                     *(f"endless-{i}" for i in range(ENDLESS)), "chat"]
            await wait_until(lambda: all((gate.parent / f"started-{n}").exists()
                                         for n in names), "every request to start")
            server.process.send_signal(signal.SIGTERM)
            for connection in idle:  # closed when the drain begins
                assert await connection.receive_some() == b""
            gate.touch()
    await trio.to_thread.run_sync(server.wait)
    return outcomes


def _shutdown(data: str) -> bool:
    return json.loads(data)["error"]["code"] == "server_shutdown"


async def _lines(http: httpx.AsyncClient, graph: str, name: str) -> list[str]:
    async with http.stream("POST", f"/v1/graphs/{graph}",
                           json={"inputs": {"text": name}, "stream": True}) as response:
        return [line async for line in response.aiter_lines()
                if line and not line.startswith(":")]  # no blank lines, no pings


async def _gated_stream(http: httpx.AsyncClient, name: str, outcomes: dict[str, str]) -> None:
    lines = await _lines(http, "waiting", name)
    items = [json.dumps({"output": "output", "item": i}) for i in ("before", "after")]
    if lines == [f"data: {items[0]}", f"data: {items[1]}", "data: [DONE]"]:
        outcomes[name] = "finished"
    else:
        assert lines[:2] == [f"data: {items[0]}", "event: error"], lines
        assert len(lines) == 3 and _shutdown(lines[2].removeprefix("data: ")), lines
        outcomes[name] = "cut"


async def _gated_request(http: httpx.AsyncClient, name: str, outcomes: dict[str, str]) -> None:
    answer = await http.post("/v1/graphs/waiting", json={"inputs": {"text": name}})
    if answer.status_code == 200:
        assert answer.json() == {"output": ["before", "after"]}
        outcomes[name] = "finished"
    else:
        assert answer.status_code == 503 and _shutdown(answer.text), answer.text
        outcomes[name] = "cut"


async def _endless_stream(http: httpx.AsyncClient, name: str, outcomes: dict[str, str]) -> None:
    lines = await _lines(http, "forever", name)
    assert lines[-2] == "event: error" and _shutdown(lines[-1].removeprefix("data: ")), lines
    outcomes[name] = "cut"


async def _chat(client: openai.AsyncOpenAI, outcomes: dict[str, str]) -> None:
    chunks = await client.chat.completions.create(
        model="talk", messages=[{"role": "user", "content": "chat"}], stream=True)
    try:
        async for _ in chunks:
            pass
    except openai.APIError as exc:
        assert exc.code == "server_shutdown", exc
        outcomes["chat"] = "cut"
