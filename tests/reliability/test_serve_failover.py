"""The worker hosting a served chat graph's node SIGKILLed with replies in flight on it, as real
processes (a head, two workers, `omni serve --cluster`, clients over HTTP): each reply whose
client had been sent nothing yet runs again on the replacement and is answered whole, those
collected whole and streams before their first chunk alike. The kill lands by condition
(every call is held on the worker), never by timing."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests._wait import CAP_S, wait_until_sync
from tests.cluster.conftest import Cluster
from tests.reliability._serve_failover import (
    GRAPH,
    NUM_PLAIN,
    NUM_STREAMED,
    replies_survive_a_killed_worker,
)

URL = re.compile(r"omni serve: (http://\S+)")
pytestmark = pytest.mark.proc  # SIGKILL of a worker process under a real server


def test_replies_in_flight_on_a_killed_worker_are_answered_from_the_replacement(
        cluster: Cluster, record) -> None:
    cluster.head()
    workers = {"w1": cluster.worker("w1"), "w2": cluster.worker("w2")}
    serve = cluster.start("serve", str(GRAPH), "--port", "0", "--cluster", cluster.address,
                          "--token-file", str(cluster.token))
    wait_until_sync(lambda: URL.search("".join(serve.err)), "omni serve to listen", cap=CAP_S)
    url = URL.search("".join(serve.err))[1]

    def kill(worker: str, pid: int) -> None:
        assert workers[worker].pid == pid
        os.kill(pid, signal.SIGKILL)
        workers[worker].wait(CAP_S)

    outcome = replies_survive_a_killed_worker(url, cluster.folder, kill)
    assert "Traceback" not in "".join(serve.err)
    record("serve.worker_killed", tries=NUM_PLAIN + NUM_STREAMED, outcome=outcome)
