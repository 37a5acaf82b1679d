"""What the runtime leaves on the machine: every file, folder and shared-memory segment it
creates is private to its user (0600 / 0700, whatever the umask), and removed on clean exit:
a store closed, a runtime leaving ``async with``, a store garbage-collected, and a real
``omni run`` process exiting (a store it never closed included)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import omni
from omni._shm import shm_directory
from omni.kv import KVConfig, TierConfig
from omni.transport.security import create_token_file
from tests.reliability._support import LAYOUT, Tally, make_store

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def arenas(store_id: str) -> list[Path]:
    return sorted(shm_directory().glob(f"omni-{store_id}-*"))


def store_paths(store) -> dict[Path, int]:
    """Each path a store made, with the mode it must have."""
    paths = {p: 0o600 for p in arenas(store.store_id)}
    memory = [t for t in store._tiers if t.name != "disk"]
    assert len(paths) == len(memory) + 1  # each memory tier's arena, and the lease table
    disk = store._tiers[-1]
    if disk.name == "disk":
        paths[disk.directory] = 0o700
        paths[disk.path] = 0o600
    return paths


def test_what_it_creates_is_private_to_its_user(tmp_path, record):
    tally = Tally()
    for mask in (0o000, 0o022):
        with umask(mask):
            root = tmp_path / f"umask-{mask:o}"
            kv = root / "deep" / "er" / "kv"  # missing folders: each created 0700
            with make_store(device=4, host=4, disk=4, path=kv) as store:
                paths = store_paths(store)
                paths.update({root / "deep": 0o700, root / "deep" / "er": 0o700, kv: 0o700})
                token = root / "config" / "omni" / "cluster.token"
                create_token_file(token)
                paths.update({token: 0o600, token.parent: 0o700, token.parent.parent: 0o700})
                for path, expected in paths.items():
                    assert mode(path) == expected, f"{path}: {mode(path):o} under umask {mask:o}"
                    assert os.lstat(path).st_uid == os.geteuid()
                    tally("path")
    record("files.private", tries=tally["path"],
           outcome=f"{tally['path']} paths checked under umask 000 and 022 (arenas and lease "
                   "tables in shared memory, disk-tier folders and file, the token file and "
                   "its folders): files 0600, folders 0700, owned by the user")


GRAPH = textwrap.dedent('''
    import os, stat
    import torch
    import omni
    from omni.kv import KVLayout, KVStore, TierConfig
    from omni._shm import shm_directory

    KV_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4,
                         dtype=torch.float32)
    NEVER_CLOSED = []

    @omni.node
    async def made(tag: str) -> dict:
        stores = [omni.context().kv,
                  KVStore(KV_LAYOUT, [TierConfig("host", "4KiB"), TierConfig("disk", "64KiB")])]
        NEVER_CLOSED.append(stores[1])  # the interpreter's exit must remove it
        keys = [bytes([i]) * 16 for i in range(8)]
        paths = []
        for store in stores:
            store.put(keys, torch.zeros(8, *KV_LAYOUT.page_shape))
            disk = store._tiers[-1]
            paths += [*shm_directory().glob(f"omni-{store.store_id}-*"), disk.directory,
                      disk.path]
        parent = stores[1]._tiers[-1].directory.parent
        paths += [parent, parent.parent, parent.parent.parent]
        return {str(p): stat.S_IMODE(os.lstat(p).st_mode) for p in paths}

    @omni.graph
    def inspect(tag: str):
        return made(tag)
''')


@pytest.mark.proc  # a process's files and shared memory gone once it exits
def test_what_it_creates_is_removed_on_clean_exit(tmp_path, record):
    tally = Tally()
    # A store closed, and one garbage-collected.
    for close in (True, False):
        store = make_store(device=4, host=4, disk=4, path=tmp_path / "kv")
        made = store_paths(store)
        if close:
            store.close()
        else:
            del store
            gc.collect()
        assert not [p for p in made if p.exists()]
        tally("closed" if close else "collected", len(made))
    # A runtime's own store, gone when the runtime is.
    tiers = (TierConfig("device", 4 * LAYOUT.page_bytes), TierConfig("host", "4KiB"),
             TierConfig("disk", "64KiB", path=tmp_path / "rt"))
    async_made = _run_runtime(KVConfig(LAYOUT, tiers))
    assert async_made and not [p for p in async_made if p.exists()]
    tally("runtime", len(async_made))
    # A real `omni run`, under umask 000, with a store it never closes.
    graph = tmp_path / "files.py"
    graph.write_text(GRAPH)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "cli", "run", str(graph), "--input", "tag=x", "--json",
         "--kv-device", "4KiB", "--kv-host", "4KiB", "--kv-disk", "64KiB"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, umask=0)
    assert done.returncode == 0, done.stderr
    modes = json.loads(done.stdout)["output"]
    for path, got in modes.items():
        folder = not Path(path).name.startswith(("omni-", "pages.bin"))
        assert got == (0o700 if folder else 0o600), f"{path}: {got:o}"
    cache = tmp_path / "cache"
    left = [p for p in modes if Path(p).exists() and Path(p) not in (
        cache, cache / "omni", cache / "omni" / "kv")]
    assert not left, f"left behind after exit: {left}"
    assert not any((cache / "omni" / "kv").iterdir())
    tally("process", len(modes) - 3)
    tries = sum(tally.counts.values())
    record("files.removed", tries=tries,
           outcome=f"{tries} arenas, folders and files removed: store closed "
                   f"({tally['closed']}), garbage-collected ({tally['collected']}), runtime "
                   f"exited ({tally['runtime']}), `omni run` exited ({tally['process']}, a "
                   "store it never closed included); only the empty default folder stays")


def _run_runtime(config: KVConfig) -> list[Path]:
    made: list[Path] = []

    @omni.node
    async def note(x: int) -> int:
        made.extend(store_paths(omni.context().kv))
        return x

    @omni.graph
    def g(x: int):
        return note(x)

    async def main() -> None:
        async with omni.Runtime(kv=config) as rt:
            assert await rt.run(g, x=1) == 1

    trio.run(main)
    return made
