"""Ctrl-C (SIGINT) and SIGTERM in the middle of `omni run` end it the same way: the request
in flight is cancelled, the KV store's arenas, lease table and disk-tier file are removed, and
the process says one line and exits 130 or 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._wait import wait_until_sync

ROOT = Path(__file__).resolve().parents[2]

GRAPH = textwrap.dedent('''
    import json, os, sys
    import torch
    import trio
    import omni
    from omni.kv import KVLayout
    from omni._shm import shm_directory

    KV_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4,
                         dtype=torch.float32)

    @omni.node
    async def hold(tag: str) -> str:
        store = omni.context().kv
        store.put([b"k" * 16], torch.zeros(1, *KV_LAYOUT.page_shape))
        disk = store._tiers[-1]
        paths = [*map(str, shm_directory().glob(f"omni-{store.store_id}-*")), str(disk.path)]
        with open(os.environ["PATHS_FILE"], "w") as f:
            json.dump(paths, f)
        await trio.sleep_forever()  # in flight when the signal comes
        return tag

    @omni.graph
    def held(tag: str):
        return hold(tag)
''')


def _run_and_signal(tmp_path: Path, signum: int) -> tuple[int, str, list[str]]:
    graph = tmp_path / "held.py"
    graph.write_text(GRAPH)
    paths_file = tmp_path / f"paths-{signum}.json"
    env = {**os.environ, "PATHS_FILE": str(paths_file),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "run", str(graph), "--input", "tag=x", "--json",
         "--kv-host", "4KiB", "--kv-disk", "64KiB"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def started() -> bool:
            assert proc.poll() is None, proc.communicate()
            return paths_file.exists() and bool(paths_file.read_text())

        wait_until_sync(started, "the request to start", cap=120)
        paths = json.loads(paths_file.read_text())
        assert all(Path(p).exists() for p in paths) and len(paths) == 3
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, paths


@pytest.mark.proc  # SIGINT and SIGTERM exit codes and cleanup
def test_sigint_and_sigterm_mid_run_clean_up_and_exit_with_one_line(tmp_path, record):
    outcomes = []
    for signum, code, line in ((signal.SIGTERM, 143, "error: terminated"),
                               (signal.SIGINT, 130, "error: interrupted")):
        returncode, err, paths = _run_and_signal(tmp_path, signum)
        assert returncode == code, err
        said = [x for x in err.splitlines()  # a store's note on reclaiming aside
                if x.strip() and not x.startswith("removed the shared memory")]
        assert said == [line]  # no traceback
        left = [p for p in paths if Path(p).exists()]
        assert not left, f"left behind after {signal.Signals(signum).name}: {left}"
        outcomes.append(f"{signal.Signals(signum).name}: exit {code}, '{line}', "
                        f"{len(paths)} files removed")
    record("proc.run_signalled", tries=2,
           outcome="; ".join(outcomes) + " (the host arena, the lease table and the "
                   "disk-tier file, with a request in flight)")
