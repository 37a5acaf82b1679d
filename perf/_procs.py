"""`omni` CLI subprocesses for the benchmarks: a head, workers, a status query.

`CliProcess` (the tests' own, tests/_procs.py: one home for it) collects a process's output
line by line in threads, so its pipes never fill and a caller can wait for a ready line
(``omni cluster head at ...``) with a timeout. `wait_members` waits until the head lists given
workers as members, before anything is deployed on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests._procs import START_S, CliProcess

__all__ = ["START_S", "CliProcess", "cluster_status", "wait_members"]


def cluster_status(address: str, token_file: str | os.PathLike[str], *, cwd: Path,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """``omni cluster status ADDRESS --json``, parsed (RuntimeError if it fails)."""
    done = subprocess.run([sys.executable, "-m", "cli", "cluster", "status", address,
                           "--token-file", str(token_file), "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"'omni cluster status' failed ({done.returncode}): {done.stderr}")
    return json.loads(done.stdout)


def wait_members(address: str, token_file: str | os.PathLike[str],
                 workers: Mapping[str, CliProcess], *, cwd: Path,
                 env: dict[str, str] | None = None, timeout: float = START_S) -> dict[str, Any]:
    """Wait until the head lists every worker in `workers` (name -> its ``cluster join``
    process) as an up member run by that process; the last status (`cluster_status`).

    Raises:
        RuntimeError: a worker process exited, or `timeout` seconds passed first (the message
            shows what the head listed).
    """
    deadline = time.monotonic() + timeout
    while True:
        status = cluster_status(address, token_file, cwd=cwd, env=env)
        up = {m["name"]: m["pid"] for m in status["members"] if m["state"] == "up"}
        if all(up.get(name) == proc.popen.pid for name, proc in workers.items()):
            return status
        for name, proc in workers.items():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"worker '{name}' exited ({proc.popen.returncode}): "
                                   f"{''.join(proc.err)[-2000:]!r}")
        if time.monotonic() > deadline:
            seen = {m["name"]: m["state"] for m in status["members"]}
            raise RuntimeError(f"the head did not list {sorted(workers)} as members within "
                               f"{timeout:g} s (it lists {seen})")
        time.sleep(0.2)
