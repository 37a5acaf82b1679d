"""`omni serve` on any graph, in process: tests/serve/graphs.py behind `build_app`, driven
over httpx's ASGI transport, and over a loopback socket where the connection is the
behaviour (a client going away, the drain). Asserted: the answers and their shapes, every
error status and OpenAI's error object, streams in order, the key and the limits,
cancellation when a client goes away, the drain when the server is stopped, and the
command's mistakes at startup (one line, exit 2).
"""

from __future__ import annotations

import functools
import json
import socket
from pathlib import Path

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from cli.serve import _drained, _read_keys
from omni.serve import GuardState
from tests._cli import run_omni
from tests._wait import wait_until
from tests.serve._inproc import listening, served

GRAPHS = Path(__file__).with_name("graphs.py")


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the `held` graph waits for (graphs.py reads where at import)."""
    monkeypatch.setenv("OMNI_TEST_GATE", str(tmp_path / "open"))
    return tmp_path / "open"


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


async def test_a_graph_answers_json_as_omni_run_prints_it() -> None:
    async with served(GRAPHS) as app, app.http() as http:
        one = await http.post("/v1/graphs/echo", json={"inputs": {"text": "hi"}})
        many = await http.post("/v1/graphs/numbers", json={"inputs": {"n": 3}})
    assert one.status_code == 200 and one.json() == {"output": "HI!"}
    assert many.json() == {"first": "GO!", "items": [0, 1, 2]}


async def test_a_stream_is_server_sent_events_in_order_then_done() -> None:
    async with served(GRAPHS) as app, app.http() as http, http.stream(
            "POST", "/v1/graphs/numbers", json={"inputs": {"n": 5}, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = await sse_data(r)
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert [e["item"] for e in events if e["output"] == "items"] == [0, 1, 2, 3, 4]
    assert {"output": "first", "item": "GO!"} in events


async def test_models_health_and_the_api_description() -> None:
    async with served(GRAPHS) as app, app.http() as http:
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


async def test_the_official_client_lists_and_retrieves_models() -> None:
    async with served(GRAPHS) as app, app.openai() as client, app.http() as http:
        listed = {m.id: m async for m in client.models.list()}
        echo = await client.models.retrieve("echo")
        assert (echo.id, echo.object, echo.owned_by) == ("echo", "model", "omni")
        assert echo == listed["echo"]
        assert echo.model_extra == {"omni": {"endpoint": "/v1/graphs/echo"}}
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("nope")
        assert caught.value.code == "model_not_found"
        assert "'nope'" in caught.value.message and "echo" in caught.value.message
        assert_error(await http.get("/v1/models/nope"), 404, "nope")


BAD_INPUTS = [
    ({"inputs": {"txt": "x"}}, 400, ("no input 'txt'",)),
    ({"inputs": {}}, 400, ("text",)),
    ({"inputs": {"text": 3}}, 400, ("'text'", "expected `str`")),
    ({"inputs": [1]}, 400, ("inputs must be a JSON object",)),
    ({"inputs": {"text": "x"}, "stream": "yes"}, 400, ("stream",)),
    ({"inputs": {"text": "x"}, "temperature": 1}, 400, ("unknown field", "temperature")),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_INPUTS)
async def test_bad_inputs_are_400_naming_what_is_wrong(body, status, words) -> None:
    async with served(GRAPHS) as app, app.http() as http:
        assert_error(await http.post("/v1/graphs/echo", json=body), status, *words)


async def test_not_json_unknown_graphs_and_routes() -> None:
    async with served(GRAPHS) as app, app.http() as http:
        assert_error(await http.post("/v1/graphs/echo", content=b"[1"), 400, "not valid JSON")
        assert_error(await http.post("/v1/graphs/echo", content=b"\xff\xfe{"), 400, "JSON")
        deep = b"[" * 200_000
        assert_error(await http.post("/v1/graphs/echo", content=deep), 400, "nested too deeply")
        assert_error(await http.post("/v1/graphs/nope", json={}), 404, "nope", "echo")
        assert_error(await http.get("/v1/nothing"), 404, "/v1/nothing")
        assert_error(await http.get("/v1/graphs/echo"), 405)


async def test_a_node_refusing_its_input_is_400_and_a_broken_node_500() -> None:
    async with served(GRAPHS) as app, app.http() as http:
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


async def test_metrics_count_what_the_server_ran() -> None:
    async with served(GRAPHS) as app, app.http() as http:
        for _ in range(3):
            await http.post("/v1/graphs/echo", json={"inputs": {"text": "m"}})
        text = (await http.get("/metrics")).text
    requests = {s.labels["outcome"]: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "omni_requests_total" and s.labels["graph"] == "echo"}
    assert requests.get("ok", 0) >= 3


async def test_a_client_going_away_cancels_its_request(gate: Path) -> None:
    """Over a real connection: its closing is what the server must notice."""
    async with listening(GRAPHS) as server:
        for text, stream in (("gone-json", False), ("gone-sse", True)):
            async with server.http() as http:
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
        async with server.http() as http:
            await wait_until_health(http, lambda h: h["in_flight"] == 0)


async def wait_until_health(http: httpx.AsyncClient, check) -> None:
    state: dict = {}

    async def poll() -> bool:
        state.update((await http.get("/health")).json())
        return check(state)

    await wait_until(poll, "/health to match")


async def test_the_key_the_body_limit_and_the_concurrency_limit(tmp_path: Path,
                                                                gate: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret-0123456789\n")  # read as --api-key-file reads it
    state = GuardState(api_keys=_read_keys(str(key)), max_concurrency=2,
                       metrics_keys=frozenset({"operator-0123456789"}),
                       max_body_bytes=1024 * 1024)
    body = {"inputs": {"text": "x"}}
    async with served(GRAPHS, state=state) as app, app.http() as anon, \
            app.http(Authorization="Bearer s3cret-0123456789") as ok, \
            app.http(Authorization="Bearer operator-0123456789") as operator:
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
            assert (await operator.get("/metrics")).status_code == 200  # never busy
            assert_error(await anon.get("/metrics"), 401)
            gate.touch()
        assert (await ok.post("/v1/graphs/echo", json=body)).status_code == 200


async def test_a_stop_drains_the_requests_in_flight_then_the_server_returns(
        gate: Path) -> None:
    """What SIGTERM starts in ``omni serve`` (tests/reliability/test_serve_drain.py sends
    the real signal): new requests refused, the three in flight answered whole, then
    `serve` returns, counting them as finished as the command's last line says."""
    answers: list = [None] * 3
    async with listening(GRAPHS) as server, server.http() as http:

        async def call(i: int) -> None:
            answers[i] = (await http.post("/v1/graphs/held",
                                          json={"inputs": {"text": f"d{i}"}})).json()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
            await wait_until(lambda: all((gate.parent / f"started-d{i}").exists()
                                         for i in range(3)))
            server.stop.set()
            async with server.http() as fresh:
                await wait_until_health(fresh, lambda h: h["status"] == "draining")
            gate.touch()
        with trio.fail_after(60):
            await server.stopped.wait()
    assert answers == [{"output": "d0"}, {"output": "d1"}, {"output": "d2"}]
    assert (server.state.num_finished, server.state.num_cut) == (3, 0)
    assert _drained(server.state, 30) == "every request in flight finished (3), none cut"


def test_mistakes_at_startup_are_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        in_use = run_omni("serve", str(GRAPHS), "--port", port)
    empty = tmp_path / "empty"
    empty.write_text("\n# only a comment\n")
    wordy = tmp_path / "wordy"
    wordy.write_text("alice key-of-alice-0123\nbob k 2\n")
    short = tmp_path / "short"
    short.write_text("s3cret #hash\n")
    twice = tmp_path / "twice"
    twice.write_text("alice key-of-alice-0123\nbob key-of-alice-0123\n")
    cases = [
        (in_use, f"cannot listen on 127.0.0.1:{port}"),
        (run_omni("serve", str(GRAPHS), "--api-key-file", str(tmp_path / "none")),
         "cannot read it"),
        (run_omni("serve", str(GRAPHS), "--api-key-file", str(empty)), "no key in it"),
        (run_omni("serve", str(GRAPHS), "--api-key-file", str(wordy)),
         "wordy:2: expected 'KEY',"),
        (run_omni("serve", str(GRAPHS), "--api-key-file", str(short)),
         "short:1: the key is shorter than 16 characters"),
        (run_omni("serve", str(GRAPHS), "--api-key-file", str(twice)),
         "twice:2: this key is listed"),
        (run_omni("serve", str(GRAPHS), "--allow-path", str(tmp_path / "no-dir")),
         "not a folder"),
        (run_omni("serve", str(GRAPHS), "nope"), "nope"),
        (run_omni("serve", str(tmp_path / "missing.py")), "no such file"),
    ]
    for result, words in cases:
        assert result.returncode == 2, (result.args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
