"""A served chat graph's replies held on a worker that is then killed: the scenario
tests/reliability/test_serve_failover.py runs against a real `omni serve --cluster`
(`serve_failover_graph.py` is the graph; the kill is the caller's, so that a cluster of
another kind can run it too)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests._wait import CAP_S, wait_until_sync
from tests.cluster.conftest import ROOT
from tests.reliability import serve_failover_graph as g

__all__ = ["GRAPH", "NUM_PLAIN", "NUM_STREAMED", "replies_survive_a_killed_worker"]

GRAPH = ROOT / "tests" / "reliability" / "serve_failover_graph.py"
NUM_PLAIN, NUM_STREAMED = 6, 2  # the replies in flight on the worker when it is killed


def ask(url: str, folder: Path, name: str, stream: bool) -> tuple[int, str]:
    """One chat completion: its status and its reply's text (a stream's deltas joined; an
    error event's data instead, if one came)."""
    body = {"model": "talk", "messages": [{"role": "user", "content": f"{folder} {name}"}],
            "stream": stream}
    try:
        return _ask(url, body, stream)
    except httpx.TransportError as exc:  # what the assertion shows, instead of a dead thread
        return 0, f"{type(exc).__name__}: {exc}"


def _ask(url: str, body: dict[str, object], stream: bool) -> tuple[int, str]:
    with httpx.Client(timeout=CAP_S * 2) as client:
        if not stream:
            answer = client.post(f"{url}/v1/chat/completions", json=body)
            if answer.status_code != 200:
                return answer.status_code, answer.text
            return 200, answer.json()["choices"][0]["message"]["content"]
        parts: list[str] = []
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
            event = ""
            for line in answer.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                    if event == "error":
                        return 500, data
                    delta = json.loads(data)["choices"]
                    parts += [d["delta"].get("content") or "" for d in delta]
            return answer.status_code, "".join(parts)


def replies_survive_a_killed_worker(url: str, folder: Path,
                                    kill: Callable[[str, int], None]) -> str:
    """Hold `NUM_PLAIN` replies collected whole and `NUM_STREAMED` streams on the node's
    worker, `kill(worker, pid)` it, let the replacement answer; assert every reply came back
    whole from the replacement. The record's outcome."""
    (folder / g.HOLD).touch()
    names = [(f"plain{i}", False) for i in range(NUM_PLAIN)] + [
        (f"streamed{i}", True) for i in range(NUM_STREAMED)]
    answers: dict[str, tuple[int, str]] = {}

    def client(name: str, stream: bool) -> None:
        answers[name] = ask(url, folder, name, stream)

    threads = [threading.Thread(target=client, args=n, daemon=True) for n in names]
    for thread in threads:
        thread.start()
    wait_until_sync(lambda: len(g.notes(folder, "holding")) == len(names),
                    "every reply held on its worker")
    ((victim, pid),) = {(worker, pid) for _, worker, pid in g.notes(folder, "holding")}
    kill(victim, pid)
    (folder / g.HOLD).unlink()  # the replacement answers at once
    for thread in threads:
        thread.join(CAP_S * 2)

    (survivor,) = {w for _, w, _ in g.notes(folder, "started")} - {victim}
    assert answers == {name: (200, f"{name} from {survivor}") for name, _ in names}, answers
    again = sorted(name for name, worker, _ in g.notes(folder, "started") if worker == survivor)
    assert again == sorted(name for name, _ in names)
    return (f"{len(names)}/{len(names)} replies in flight on the killed worker ({NUM_PLAIN} "
            f"collected whole, {NUM_STREAMED} streams before their first chunk) ran again on "
            "the replacement and were answered 200 whole")
