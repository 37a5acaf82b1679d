"""The worker hosting a class node SIGKILLed in the middle of `omni run -c 4 --cluster`, as
real processes (a head, workers, the run): with another worker up every request is answered,
the call in flight on the dead worker and those queued behind it on the replacement; with no
worker left, each request fails after `--replace-timeout` with a line naming the node and the
timeout. The kill lands by condition (a call is held on the worker), never by timing."""

from __future__ import annotations

import json

import pytest

from tests._wait import CAP_S, wait_until_sync
from tests.cluster.conftest import ROOT, Cluster
from tests.reliability import failover_graph as g

GRAPH = ROOT / "tests" / "reliability" / "failover_graph.py"
pytestmark = pytest.mark.proc  # SIGKILL of a worker process mid-run


def notes(cluster: Cluster) -> list[tuple[str, int, str]]:
    """(what, request, worker) for each line the class node wrote: served or holding."""
    path = cluster.folder / g.SERVED
    lines = path.read_text().splitlines() if path.exists() else []
    return [(what, int(i), worker) for what, i, worker in (line.split() for line in lines)]


def start_run(cluster: Cluster, num_requests: int, *extra: str):
    inputs = cluster.folder / "requests.jsonl"
    inputs.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(num_requests)))
    return cluster.start("run", str(GRAPH), "--cluster", cluster.address, "--token-file",
                         str(cluster.token), "--inputs-json", str(inputs), "--json",
                         "-c", "4", *extra)


def hold_from(cluster: Cluster, request: int) -> None:
    """Make the first call for `request` or a later one wait on its worker (see `g.HOLD`)."""
    (cluster.folder / g.HOLD).write_text(str(request))


def held_call(cluster: Cluster) -> tuple[int, str]:
    """Once a call is held in flight: its request, and the worker it is on."""
    wait_until_sync(lambda: any(what == "holding" for what, _, _ in notes(cluster)),
                    "a call held on the worker")
    (_, request, worker), = [n for n in notes(cluster) if n[0] == "holding"]
    return request, worker


def test_the_worker_hosting_a_class_node_killed_mid_run_every_request_answered(
        cluster: Cluster, record) -> None:
    num_requests = 120
    cluster.head()
    workers = {"w1": cluster.worker("w1"), "w2": cluster.worker("w2")}
    hold_from(cluster, 30)
    run = start_run(cluster, num_requests)
    held, victim = held_call(cluster)
    workers[victim].popen.kill()
    workers[victim].wait(CAP_S)
    (cluster.folder / g.HOLD).unlink()  # the replacement serves the held call at once
    assert run.wait(CAP_S * 2) == 0, "".join(run.err)[-3000:]

    # Every request answered, in order, with its own value; the dead worker's calls moved.
    answers = [json.loads(line) for line in run.out]
    assert [a["output"]["i"] for a in answers] == list(range(num_requests))
    survivor = ({"w1", "w2"} - {victim}).pop()
    after = [a["output"]["worker"] for a in answers[held:]]
    assert answers[held]["output"]["worker"] == survivor  # the call in flight, retried
    assert set(after) == {survivor}
    served = notes(cluster)
    assert ("served", held, survivor) in served and ("served", held, victim) not in served
    before_kill = sum(1 for what, _, w in served if what == "served" and w == victim)
    record("proc.worker_killed_mid_run", tries=num_requests,
           outcome=f"{num_requests}/{num_requests} answered in order, exit 0: {before_kill} "
                   "on the killed worker before, then the call held in flight there (retried "
                   f"once) and the {num_requests - before_kill - 1} after it on the "
                   "replacement on the other worker")


def test_with_no_worker_left_requests_fail_after_the_replace_timeout(
        cluster: Cluster, record) -> None:
    num_requests = 10
    cluster.head()
    worker = cluster.worker("w1")
    hold_from(cluster, 3)
    run = start_run(cluster, num_requests, "--replace-timeout", "2")
    held, _ = held_call(cluster)
    worker.popen.kill()
    assert run.wait(CAP_S * 2) == 1, "".join(run.err)[-3000:]

    answers = [json.loads(line) for line in run.out]
    assert len(answers) == num_requests
    served = {i for what, i, _ in notes(cluster) if what == "served"}
    ok = {i for i, a in enumerate(answers) if "output" in a}
    failed = [a["error"] for a in answers if "error" in a]
    assert ok == served and held not in ok
    assert len(failed) == num_requests - len(ok)
    expected = ("NoLiveReplica: no live replica of 'Counter' within the replace timeout of "
                "2 s: its workers (w1) are gone and no other could host it")
    assert all(e["node"] == "Counter" and e["message"] == expected for e in failed), failed
    err = "".join(run.err)
    assert err.count("node 'Counter' failed") == len(failed) and "Traceback" not in err
    record("proc.no_worker_left", tries=num_requests,
           outcome=f"{len(ok)} answered before the kill; {len(failed)}/{len(failed)} after it "
                   "(the call in flight included) failed once they had waited 2 s, each "
                   "naming the node and the timeout; exit 1")
