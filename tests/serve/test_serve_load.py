"""`omni serve examples/omni_dialogue.py` under chat load, as a client and an operator see it:
a client dropping its stream mid-reply cancels the reply (seen in /metrics: the call ends
failed, nothing stays in flight or pinned), and SIGTERM during load drains the requests in
flight, exits 0 and leaves none of its shared memory behind.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests._wait import wait_until_sync
from tests.serve._server import ROOT, running

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
LONG = 4000  # tokens: a reply still being written when its client goes away
# Greedy: a sampled reply of the tiny random model could end at EOS after a token or two
# (fresh-clone CI once saw a stream of one chunk); greedy replies are the same every run.
GREEDY = {"temperature": 0}


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def chat_client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_client_dropping_its_stream_cancels_the_reply(tmp_path: Path) -> None:
    with running(DIALOGUE, env={"OMNI_SHM_DIR": str(tmp_path)}) as server:
        client = chat_client(server.url)
        before = metric(server.url, "omni_replica_calls_total", node="Chat", outcome="failed")
        stream = client.chat.completions.create(
            model="chat", max_tokens=LONG, stream=True, **GREEDY,
            messages=[{"role": "user", "content": "Tell me a long story."}])
        chunks = 0
        for _ in stream:
            chunks += 1
            if chunks == 3:
                break
        stream.close()  # the connection goes: the server must stop writing the reply
        assert chunks == 3
        wait_until_sync(lambda: metric(server.url, "omni_replica_calls_total", node="Chat",
                                       outcome="failed") == before + 1,
                        "the dropped reply's call to end as failed (cancelled)")
        assert metric(server.url, "omni_replica_in_flight", node="Chat") == 0
        assert metric(server.url, "omni_kv_pinned_pages") == 0
        assert metric(server.url, "omni_replica_calls_total", node="Chat", outcome="ok") == 0
        reply = client.chat.completions.create(  # the server goes on
            model="chat", max_tokens=4, **GREEDY, messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason == "length"


def test_sigterm_under_load_drains_then_leaves_no_shared_memory(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    with running(DIALOGUE, env={"OMNI_SHM_DIR": str(shm)}) as server:
        client = chat_client(server.url)
        client.chat.completions.create(model="chat", max_tokens=4, **GREEDY,
                                       messages=[{"role": "user", "content": "warm up"}])
        assert any(shm.iterdir()), "the runtime's KV store lives in OMNI_SHM_DIR"
        results: list[object] = []

        def one(i: int) -> None:
            try:
                reply = client.chat.completions.create(
                    model="chat", max_tokens=256, **GREEDY,
                    messages=[{"role": "user", "content": f"Question {i}"}])
                results.append(reply.choices[0].finish_reason)
            except Exception as exc:  # what a client would see: asserted below
                results.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        wait_until_sync(lambda: metric(server.url, "omni_replica_in_flight", node="Chat") > 0,
                        "requests in flight")
        code = server.stop()
        for thread in threads:
            thread.join(timeout=120)
        assert code == 0, server.stderr()
        assert "stopped (SIGTERM); every request in flight finished" in server.stderr()
    # a request the server took before the signal finished whole; one that came after was
    # refused (503) or found nobody listening
    finished = [r for r in results if isinstance(r, str)]  # "length" or "stop"
    assert len(results) == 8 and finished, results
    for r in results:
        assert r in ("length", "stop") or isinstance(r, openai.APIConnectionError) or (
            isinstance(r, openai.APIStatusError) and r.status_code == 503), r
    assert list(shm.iterdir()) == []  # arenas, lease tables: all gone
