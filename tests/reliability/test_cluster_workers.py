"""A cluster worker's failures as the user meets them at ``omni run --cluster``: a class node
failing as it starts on a worker (one ``error:`` line with the node, the worker and the error's
own type and message; the worker's traceback with ``--debug``), and a worker started without
the environment the graph file reads (``OMNI_MODEL``), refused before it builds anything, with
both KV layouts named. The workers are real ``omni cluster join`` processes, started with their
own environment; the driver runs in this process."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests._cli import run_omni
from tests.cluster.conftest import Cluster

GRAPH = textwrap.dedent('''
    import os
    import torch
    import trio
    import omni
    from omni.kv import KVLayout

    # As examples/omni_dialogue.py does: the model, hence the KV layout, from the environment.
    MODEL = os.environ.get("OMNI_MODEL", "")
    KV_LAYOUT = KVLayout(num_layers=4 if MODEL else 2, num_kv_heads=2, head_dim=8,
                         page_size=16, dtype=torch.float32)

    @omni.node
    class Loader:
        def __init__(self):
            raise ValueError("bad weights path")

        async def __call__(self, x: int) -> int:
            return x

    @omni.node
    class Model:
        def __init__(self):
            store = omni.context().kv  # made from the driver's layout, as an engine checks it
            if store.layout != KV_LAYOUT:
                raise ValueError(f"the KV store's layout {store.layout} does not match the "
                                 f"model's {KV_LAYOUT}")
            open("built", "w").close()

        async def __call__(self, x: int) -> int:
            return x

    @omni.node
    class Divider:
        async def __call__(self, x: int) -> float:
            async with trio.open_nursery() as nursery:  # its error is a group of one
                nursery.start_soon(self.divide, x)
            return 1.0

        async def divide(self, x: int) -> None:
            raise ZeroDivisionError(f"cannot divide {x} by zero")

    @omni.node
    class Counter:
        async def __call__(self, x: int):
            yield x
            raise RuntimeError("the counter broke after one item")

    @omni.graph
    def loads(x: int):
        return Loader()(x)

    @omni.graph
    def divides(x: int):
        return Divider()(x)

    @omni.graph
    def counts(x: int):
        return Counter()(x)

    @omni.graph
    def answers(x: int):
        return Model()(x)
''')


def run_on(cluster: Cluster, graph: str, *extra: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert cluster.address is not None
    return run_omni("run", "graph.py", graph, "-i", "x=1", "--cluster", cluster.address,
                    "--token-file", str(cluster.token), *extra, cwd=cluster.folder,
                    env={"XDG_CACHE_HOME": str(cluster.folder / "cache"), **(env or {})})


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.proc  # the worker is a process of its own: its error crosses the wire
def test_a_node_failing_as_it_starts_on_a_worker_names_its_own_error(cluster: Cluster,
                                                                      record) -> None:
    (cluster.folder / "graph.py").write_text(GRAPH)
    cluster.head()
    cluster.worker("w1")
    done = run_on(cluster, "loads")
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        "error: node 'Loader' failed to start on worker 'w1': ValueError: bad weights path"]
    debug = run_on(cluster, "loads", "--debug")
    assert debug.returncode == 1 and "ExceptionGroup" not in debug.stderr, debug.stderr
    assert error_lines(debug) == error_lines(done)
    # the worker's own traceback, down to the line in the graph file that raised
    worker_side = debug.stderr.split("on worker 'w1':\nTraceback", 1)
    assert len(worker_side) == 2, debug.stderr
    assert 'raise ValueError("bad weights path")' in worker_side[1]
    record("cli.worker_start_error", tries=2,
           outcome="2/2 exit 1 with one `error:` line naming the node, the worker and "
                   "`ValueError: bad weights path` (no ExceptionGroup); with --debug the "
                   "worker's traceback down to the raising line too")


@pytest.mark.proc  # the worker is a process of its own: its error crosses the wire
@pytest.mark.parametrize("graph, node, raised", [
    ("divides", "Divider", 'raise ZeroDivisionError(f"cannot divide {x} by zero")'),
    ("counts", "Counter", 'raise RuntimeError("the counter broke after one item")')],
    ids=["call", "stream"])
def test_a_node_failing_in_a_call_on_a_worker_names_its_own_error(
        cluster: Cluster, graph: str, node: str, raised: str) -> None:
    (cluster.folder / "graph.py").write_text(GRAPH)
    cluster.head()
    cluster.worker("w1")
    done = run_on(cluster, graph)
    assert done.returncode == 1, done
    (line,) = error_lines(done)
    assert line.startswith(f"error: node '{node}' failed") and "on worker 'w1'" in line, line
    assert "ExceptionGroup" not in line and "Traceback" not in done.stderr, done.stderr
    debug = run_on(cluster, graph, "--debug")
    assert debug.returncode == 1 and "ExceptionGroup" not in debug.stderr, debug.stderr
    worker_side = debug.stderr.split("on worker 'w1':\nTraceback", 1)
    assert len(worker_side) == 2, debug.stderr
    assert raised in worker_side[1], debug.stderr


@pytest.mark.proc  # the worker's environment is its process's own
def test_a_worker_without_the_drivers_environment_is_refused(cluster: Cluster,
                                                              record) -> None:
    (cluster.folder / "graph.py").write_text(GRAPH)
    model = cluster.folder / "model"
    model.mkdir()
    cluster.head()
    cluster.worker("w1", env={"OMNI_MODEL": ""})  # `omni cluster join` without OMNI_MODEL
    done = run_on(cluster, "answers", env={"OMNI_MODEL": str(model)})
    assert done.returncode == 1 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: node 'Model' failed to start on worker 'w1': "
                           "LayoutMismatch: KV_LAYOUT of "), line
    assert ("is num_layers=4 num_kv_heads=2 head_dim=8 page_size=16 dtype=float32 on the "
            "driver but num_layers=2 num_kv_heads=2 head_dim=8 page_size=16 dtype=float32 on "
            "worker 'w1'") in line
    assert "OMNI_MODEL" in line and "omni cluster join" in line
    assert not (cluster.folder / "built").exists()  # refused before the node was built
    # with the same environment on both sides the node starts and answers
    same = run_on(cluster, "answers")
    assert same.returncode == 0 and same.stdout.strip() == "1", same
    record("cli.worker_environment", tries=2,
           outcome="refused before the node was built: one `error:` line (exit 1) naming "
                   "the file's KV_LAYOUT on the driver and on the worker and OMNI_MODEL to set "
                   "for `omni cluster join`; with the same environment it ran (exit 0)")
