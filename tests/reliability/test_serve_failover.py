"""The worker hosting a served chat graph's node SIGKILLed with replies in flight on it, as real
processes (a head, two workers, `omni serve --cluster`, clients over HTTP): each reply whose
client had been sent nothing yet runs again on the replacement and is answered whole, those
collected whole and streams before their first chunk alike. The kill lands by condition
(every call is held on the worker), never by timing."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from tests._wait import CAP_S, wait_until_sync
from tests.cluster.conftest import ROOT, Cluster
from tests.reliability import serve_failover_graph as g

GRAPH = ROOT / "tests" / "reliability" / "serve_failover_graph.py"
URL = re.compile(r"omni serve: (http://\S+)")
pytestmark = pytest.mark.proc  # SIGKILL of a worker process under a real server

NUM_PLAIN, NUM_STREAMED = 6, 2  # the replies in flight on the worker when it is killed


def notes(cluster: Cluster, what: str) -> list[tuple[str, str]]:
    """(text, worker) of each line the node wrote that starts with `what`."""
    path = cluster.folder / g.SERVED
    lines = path.read_text().splitlines() if path.exists() else []
    return [(text, worker) for kind, text, worker in (line.split() for line in lines)
            if kind == what]


def ask(url: str, text: str, stream: bool) -> tuple[int, str]:
    """One chat completion: its status and its reply's text (a stream's deltas joined; an
    error event's data instead, if one came)."""
    body = {"model": "talk", "messages": [{"role": "user", "content": text}],
            "stream": stream}
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


def test_replies_in_flight_on_a_killed_worker_are_answered_from_the_replacement(
        cluster: Cluster, record) -> None:
    cluster.head()
    workers = {"w1": cluster.worker("w1"), "w2": cluster.worker("w2")}
    (cluster.folder / g.HOLD).touch()
    serve = cluster.start("serve", str(GRAPH), "--port", "0", "--cluster", cluster.address,
                          "--token-file", str(cluster.token))
    wait_until_sync(lambda: URL.search("".join(serve.err)), "omni serve to listen", cap=CAP_S)
    url = URL.search("".join(serve.err))[1]

    texts = [(f"plain{i}", False) for i in range(NUM_PLAIN)] + [
        (f"streamed{i}", True) for i in range(NUM_STREAMED)]
    answers: dict[str, tuple[int, str]] = {}

    def client(text: str, stream: bool) -> None:
        answers[text] = ask(url, text, stream)

    threads = [threading.Thread(target=client, args=t, daemon=True) for t in texts]
    for thread in threads:
        thread.start()
    wait_until_sync(lambda: len(notes(cluster, "holding")) == len(texts),
                    "every reply held on its worker")
    (victim,) = {worker for _, worker in notes(cluster, "holding")}
    workers[victim].popen.kill()
    workers[victim].wait(CAP_S)
    (cluster.folder / g.HOLD).unlink()  # the replacement answers at once
    for thread in threads:
        thread.join(CAP_S * 2)

    survivor = ({"w1", "w2"} - {victim}).pop()
    assert answers == {text: (200, f"{text} from {survivor}") for text, _ in texts}, (
        answers, "".join(serve.err)[-3000:])
    started = notes(cluster, "started")
    assert sorted(t for t, w in started if w == survivor) == sorted(t for t, _ in texts)
    assert "Traceback" not in "".join(serve.err)
    record("serve.worker_killed", tries=len(texts),
           outcome=f"{len(texts)}/{len(texts)} replies in flight on the killed worker "
                   f"({NUM_PLAIN} collected whole, {NUM_STREAMED} streams before their first "
                   "chunk) ran again on the replacement and were answered 200 whole")
