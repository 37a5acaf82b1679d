"""`omni serve` on any graph: a real server process driven over real HTTP (httpx on trio).

One server serves tests/serve/graphs.py for most tests; the limits, the key and the drain
get their own. Asserted: the answers and their shapes, every error status and OpenAI's error
object, streams in order, cancellation when a client goes away, and the drain on SIGTERM.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests._wait import wait_until, wait_until_sync
from tests.serve._server import ROOT, running

GRAPHS = Path(__file__).with_name("graphs.py")


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def url(gate: Path):
    with running(GRAPHS, env={"OMNI_TEST_GATE": str(gate)}) as server:
        yield server.url


def client(url: str, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


async def sse_data(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") async for line in response.aiter_lines()
            if line.startswith("data: ")]


async def test_a_graph_answers_json_as_omni_run_prints_it(url: str) -> None:
    async with client(url) as http:
        one = await http.post("/v1/graphs/echo", json={"inputs": {"text": "hi"}})
        many = await http.post("/v1/graphs/numbers", json={"inputs": {"n": 3}})
    assert one.status_code == 200 and one.json() == {"output": "HI!"}
    assert many.json() == {"first": "GO!", "items": [0, 1, 2]}


async def test_a_stream_is_server_sent_events_in_order_then_done(url: str) -> None:
    async with client(url) as http, http.stream(
            "POST", "/v1/graphs/numbers", json={"inputs": {"n": 5}, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = await sse_data(r)
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert [e["item"] for e in events if e["output"] == "items"] == [0, 1, 2, 3, 4]
    assert {"output": "first", "item": "GO!"} in events


async def test_models_health_and_the_api_description(url: str) -> None:
    async with client(url) as http:
        models = (await http.get("/v1/models")).json()
        health = await http.get("/health")
        spec = (await http.get("/openapi.json")).json()
    assert models["object"] == "list"
    assert {m["id"] for m in models["data"]} == {"echo", "numbers", "held", "refused",
                                                 "crashed"}
    assert health.json() == {"status": "ok", "in_flight": 0}
    body = spec["paths"]["/v1/graphs/numbers"]["post"]["requestBody"]["content"]
    inputs = body["application/json"]["schema"]["properties"]["inputs"]
    assert inputs["properties"]["n"]["type"] == "integer" and inputs["required"] == ["n"]


def test_the_official_client_lists_and_retrieves_models(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    listed = {m.id: m for m in client.models.list()}
    echo = client.models.retrieve("echo")
    assert (echo.id, echo.object, echo.owned_by) == ("echo", "model", "omni")
    assert echo == listed["echo"]
    assert echo.model_extra == {"omni": {"endpoint": "/v1/graphs/echo"}}
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.code == "model_not_found"
    assert "'nope'" in caught.value.message and "echo" in caught.value.message
    with httpx.Client(base_url=url, timeout=60) as http:
        assert_error(http.get("/v1/models/nope"), 404, "nope")


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"inputs": {"txt": "x"}}, 400, ("no input 'txt'",)),
    ({"inputs": {}}, 400, ("text",)),
    ({"inputs": {"text": 3}}, 400, ("'text'", "expected `str`")),
    ({"inputs": [1]}, 400, ("inputs must be a JSON object",)),
    ({"inputs": {"text": "x"}, "stream": "yes"}, 400, ("stream",)),
    ({"inputs": {"text": "x"}, "temperature": 1}, 400, ("unknown field", "temperature")),
])
async def test_bad_inputs_are_400_naming_what_is_wrong(url: str, body, status, words) -> None:
    async with client(url) as http:
        assert_error(await http.post("/v1/graphs/echo", json=body), status, *words)


async def test_not_json_unknown_graphs_and_routes(url: str) -> None:
    async with client(url) as http:
        assert_error(await http.post("/v1/graphs/echo", content=b"[1"), 400, "not valid JSON")
        assert_error(await http.post("/v1/graphs/echo", content=b"\xff\xfe{"), 400, "JSON")
        deep = b"[" * 200_000
        assert_error(await http.post("/v1/graphs/echo", content=deep), 400, "nested too deeply")
        assert_error(await http.post("/v1/graphs/nope", json={}), 404, "nope", "echo")
        assert_error(await http.get("/v1/nothing"), 404, "/v1/nothing")
        assert_error(await http.get("/v1/graphs/echo"), 405)


async def test_a_node_refusing_its_input_is_400_and_a_broken_node_500(url: str) -> None:
    async with client(url) as http:
        refused = await http.post("/v1/graphs/refused", json={"inputs": {"text": "x"}})
        crashed = await http.post("/v1/graphs/crashed", json={"inputs": {"text": "x"}})
        async with http.stream("POST", "/v1/graphs/crashed",
                               json={"inputs": {"text": "x"}, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
        after = await http.post("/v1/graphs/echo", json={"inputs": {"text": "still"}})
    assert_error(refused, 400, "node 'refuse' failed", "ValueError", "cannot take 'x'")
    assert_error(crashed, 500, "node 'crash' failed", "the node broke")
    assert "event: error" in lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert data[0]["error"]["message"] == "node 'crash' failed: RuntimeError: the node broke"
    assert after.json() == {"output": "STILL!"}  # the server goes on


async def test_metrics_count_what_the_server_ran(url: str) -> None:
    async with client(url) as http:
        for _ in range(3):
            await http.post("/v1/graphs/echo", json={"inputs": {"text": "m"}})
        text = (await http.get("/metrics")).text
    requests = {s.labels["outcome"]: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "omni_requests_total" and s.labels["graph"] == "echo"}
    assert requests.get("ok", 0) >= 3


async def test_a_client_going_away_cancels_its_request(url: str, gate: Path) -> None:
    for text, stream in (("gone-json", False), ("gone-sse", True)):
        async with client(url) as http:
            async with trio.open_nursery() as nursery:

                async def call(text: str = text, stream: bool = stream) -> None:
                    await http.post("/v1/graphs/held",
                                    json={"inputs": {"text": text}, "stream": stream})

                nursery.start_soon(call)
                started = gate.parent / f"started-{text}"
                await wait_until(started.exists, f"{text}'s node to start")
                nursery.cancel_scope.cancel()  # the connection closes
        cancelled = gate.parent / f"cancelled-{text}"
        await wait_until(cancelled.exists, f"{text}'s node to be cancelled")
    async with client(url) as http:
        await wait_until_health(http, lambda h: h["in_flight"] == 0)


async def wait_until_health(http: httpx.AsyncClient, check) -> None:
    state = {}

    async def poll() -> bool:
        state.update((await http.get("/health")).json())
        return check(state)

    with trio.move_on_after(60) as scope:
        while not await poll():
            await trio.sleep(0.02)
    assert not scope.cancelled_caught, f"health never matched: {state}"


def test_the_key_the_body_limit_and_the_concurrency_limit(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    gate = tmp_path / "open"
    with running(GRAPHS, "--api-key-file", str(key), "--max-concurrency", "2",
                 "--max-body-mib", "1", env={"OMNI_TEST_GATE": str(gate)}) as server:
        trio.run(_limits, server.url, gate)


async def _limits(url: str, gate: Path) -> None:
    body = {"inputs": {"text": "x"}}
    async with client(url) as anon, client(url, headers={"Authorization": "Bearer s3cret"}) as ok:
        assert_error(await anon.post("/v1/graphs/echo", json=body), 401, "API key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await anon.post("/v1/graphs/echo", json=body, headers=wrong), 401)
        assert (await anon.get("/health")).status_code == 200  # open: for load balancers
        assert (await ok.post("/v1/graphs/echo", json=body)).json() == {"output": "X!"}
        big = {"inputs": {"text": "x" * (1024 * 1024)}}
        assert_error(await ok.post("/v1/graphs/echo", json=big), 413, "limit")

        async def chunks():
            yield b'{"inputs": {"text": "'
            for _ in range(300):
                yield b"y" * 4096
            yield b'"}}'

        assert_error(await ok.post("/v1/graphs/echo", content=chunks()), 413)
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(functools.partial(
                    ok.post, "/v1/graphs/held", json={"inputs": {"text": f"h{i}"}}))
            await wait_until(lambda: all((gate.parent / f"started-h{i}").exists()
                                         for i in range(2)))
            busy = await ok.post("/v1/graphs/echo", json=body)
            assert_error(busy, 429, "--max-concurrency is 2")
            assert busy.headers["retry-after"] == "1"
            assert (await ok.get("/metrics")).status_code == 200  # a scrape is never busy
            assert_error(await anon.get("/metrics"), 401)
            gate.touch()
        assert (await ok.post("/v1/graphs/echo", json=body)).status_code == 200


def test_sigterm_drains_requests_in_flight_then_exits_0(tmp_path: Path) -> None:
    gate = tmp_path / "open"
    with running(GRAPHS, env={"OMNI_TEST_GATE": str(gate)}) as server:
        answers = trio.run(_drain, server, gate)
        assert server.process.returncode == 0, server.stderr()
        assert "stopped (SIGTERM); every request in flight finished (3), none cut" in \
            server.stderr()
    assert answers == [{"output": "d0"}, {"output": "d1"}, {"output": "d2"}]


async def _drain(server, gate: Path) -> list:
    answers: list = [None] * 3
    async with client(server.url) as http:

        async def call(i: int) -> None:
            answers[i] = (await http.post("/v1/graphs/held",
                                          json={"inputs": {"text": f"d{i}"}})).json()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
            await wait_until(lambda: all((gate.parent / f"started-d{i}").exists()
                                         for i in range(3)))
            server.process.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(_wait_refusing, server.url)
            gate.touch()
    await trio.to_thread.run_sync(server.wait)
    return answers


def _wait_refusing(url: str) -> None:
    """Return once the server stops taking new requests (503, or no new connection)."""

    def refusing() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            return True

    wait_until_sync(refusing, "the server to refuse new requests")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_mistakes_at_startup_are_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        in_use = run_cli(str(GRAPHS), "--port", port)
    empty = tmp_path / "empty"
    empty.write_text("\n# only a comment\n")
    wordy = tmp_path / "wordy"
    wordy.write_text("alice k1\nbob k 2\n")
    twice = tmp_path / "twice"
    twice.write_text("alice k1\nbob k1\n")
    cases = {
        in_use: f"cannot listen on 127.0.0.1:{port}",
        run_cli(str(GRAPHS), "--api-key-file", str(tmp_path / "none")): "cannot read it",
        run_cli(str(GRAPHS), "--api-key-file", str(empty)): "no key in it",
        run_cli(str(GRAPHS), "--api-key-file", str(wordy)): "wordy:2: expected 'KEY' or",
        run_cli(str(GRAPHS), "--api-key-file", str(twice)): "twice:2: this key is listed",
        run_cli(str(GRAPHS), "--allow-path", str(tmp_path / "no-dir")): "not a folder",
        run_cli(str(GRAPHS), "nope"): "nope",
        run_cli(str(tmp_path / "missing.py")): "no such file",
    }
    for result, words in cases.items():
        assert result.returncode == 2, (result.args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
