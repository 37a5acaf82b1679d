"""The guard's drain in process, on plain ASGI callables (no server): what a request cut by
`GuardState.cut` sends last, and how the guard counts requests that finish or are cut."""

from __future__ import annotations

import json

import trio

from omni.serve._guard import Guard, GuardState
from tests._wait import wait_until

SSE = [(b"content-type", b"text/event-stream")]


def scope(path: str = "/v1/graphs/g") -> dict:
    return {"type": "http", "path": path, "headers": [], "method": "POST"}


async def receive() -> dict:
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def endless_stream(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    while True:
        await send({"type": "http.response.body", "body": b"data: x\r\n\r\n",
                    "more_body": True})
        await trio.sleep(0.001)  # under the autojump clock: no real time passes


async def endless_work(scope, receive, send) -> None:
    await trio.sleep_forever()  # nothing sent yet


def gated_answer(gate: trio.Event):
    async def app(scope, receive, send) -> None:
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def call(guard: Guard, sent: list[dict], path: str = "/v1/graphs/g") -> None:
    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope(path), receive, send)


async def test_a_cut_stream_ends_with_an_error_event_and_a_cut_request_gets_503(
        autojump_clock) -> None:
    state = GuardState()
    stream, work = [], []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, Guard(endless_stream, state), stream)
        nursery.start_soon(call, Guard(endless_work, state), work)
        await wait_until(lambda: state.in_flight == 2 and len(stream) > 2)
        state.draining = True
        state.cut()
        await state.wait_idle()
    assert (state.in_flight, state.num_cut, state.num_finished) == (0, 2, 0)
    last = stream[-1]
    assert last["more_body"] is False and all(m["more_body"] for m in stream[1:-1])
    event, data = last["body"].decode().split("\r\n")[:2]
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["code"] == "server_shutdown"
    start, body = work
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert (b"connection", b"close") in start["headers"]  # sent while draining
    assert json.loads(body["body"])["error"]["code"] == "server_shutdown"


async def test_requests_that_end_during_the_drain_count_as_finished_new_ones_get_503() -> None:
    state, gate = GuardState(), trio.Event()
    guard = Guard(gated_answer(gate), state)
    answers: list[list[dict]] = [[], [], []]
    async with trio.open_nursery() as nursery:
        for sent in answers[:2]:
            nursery.start_soon(call, guard, sent)
        await wait_until(lambda: state.in_flight == 2)
        state.draining = True
        await call(guard, answers[2])  # arrives during the drain
        assert state.num_finished == 0 and answers[2][0]["status"] == 503
        gate.set()
        await state.wait_idle()
    assert (state.in_flight, state.num_finished, state.num_cut) == (0, 2, 0)
    assert [a[0]["status"] for a in answers[:2]] == [200, 200]
    state.cut()  # nothing left to cut
    assert state.num_cut == 0
