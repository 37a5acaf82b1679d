"""`perf/gpu_check.py`'s transfer figures: KV pages between the CUDA device tier and the
pinned host tier, and pages handed to a second process by CUDA IPC handle. Every figure is
measured beside its baseline in the same run (`alternate`: rounds in alternating order, one
warm-up round first).

- `tier_copies`: 256 MiB of pages host -> device and device -> host, page by page through
  `DeviceTier.write` and `DeviceTier.read_into` (the copies a promotion and a demotion make)
  in one `batched_copies` block, as the store makes them (and, to compare, waited for page by
  page), and through `KVStore.acquire` of pages on the host tier (each promoted, another
  demoted to make room), against torch copying the same bytes as one tensor between the same
  pinned memory and the GPU. The claim is the lowest of the three ratios.
- `ipc_handoff`: 256 MiB of leased pages of a CUDA device tier to a second process, by CUDA
  IPC handle (`pack_value(..., cuda_ipc=True)`: the receiver maps the sender's memory) against
  a copy through pinned shared memory (device -> host here, host -> device there).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from omni._shm import Segment
from omni.kv import KVLayout, KVStore, TierConfig
from omni.kv.tiers.device import DeviceTier
from omni.kv.tiers.host import HostTier
from omni.kv.tiers.memory import batched_copies
from omni.transport.values import pack_value
from perf._common import Samples, alternate
from perf._gpu_receiver import ANSWER, HEADER

__all__ = ["ipc_handoff", "tier_copies"]

ROOT = Path(__file__).resolve().parent.parent
KEY = bytes(16)


def _gib_per_s(nbytes: int, seconds: Samples) -> Samples:
    return seconds.map(lambda s: nbytes / s / (1 << 30))


def _timed(fn: Callable[[], None]) -> Callable[[], float]:
    """A measure: seconds `fn` takes, the GPU idle before and done after."""
    def measure() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    return measure


def tier_copies(layout: KVLayout, nbytes: int, repeats: int) -> dict[str, Any]:
    """Device <-> host GB/s through the tiers and the store vs torch's copy of the same bytes."""
    n = nbytes // layout.page_bytes
    moved = n * layout.page_bytes
    store_id = secrets.token_hex(8)
    device = DeviceTier.create(layout, n, store_id, "cuda")
    host = HostTier.create(layout, n, store_id)
    try:
        assert host.arena is not None and host.arena.pinned
        host.reserve(n - 1)
        device.pool.copy_(torch.randn(device.pool.shape, device="cuda").to(layout.dtype))
        h2d_pool, d2h_pool = device.pool, host.pool

        def tier(h2d: bool, batched: bool) -> Callable[[], None]:
            """Every page through the device tier, as the store copies them (`batched`: in
            one `batched_copies` block, else waited for one by one)."""
            def copy() -> None:
                with batched_copies() if batched else contextlib.nullcontext():
                    for slot in range(n):
                        if h2d:
                            device.write(slot, host.view(slot), KEY)
                        else:
                            device.read_into(slot, host.view(slot), KEY)
            return copy

        seconds = alternate({
            "torch_h2d": _timed(lambda: h2d_pool.copy_(d2h_pool, non_blocking=True)),
            "torch_d2h": _timed(lambda: d2h_pool.copy_(h2d_pool, non_blocking=True)),
            "tier_h2d": _timed(tier(h2d=True, batched=True)),
            "tier_d2h": _timed(tier(h2d=False, batched=True)),
            "tier_h2d_waiting_each": _timed(tier(h2d=True, batched=False)),
            "tier_d2h_waiting_each": _timed(tier(h2d=False, batched=False)),
        }, repeats)
        assert torch.equal(device.view(n - 1).cpu(), host.view(n - 1))
    finally:
        device.close()
        host.close()
    rates = {name: _gib_per_s(moved, s) for name, s in seconds.items()}
    store = _store_moves(layout, n, repeats)
    # the store moves the bytes both ways: against torch's two copies, one after the other
    torch_both = _gib_per_s(2 * moved, Samples(tuple(a + b for a, b in zip(
        seconds["torch_h2d"].values, seconds["torch_d2h"].values, strict=True))))
    return {
        "bytes": moved, "pages": n, "page_bytes": layout.page_bytes,
        "gib_per_s": {name: r.to_json(2) for name, r in rates.items()},
        "store": store,
        "vs_torch": {
            "h2d": round(rates["tier_h2d"].median / rates["torch_h2d"].median, 3),
            "d2h": round(rates["tier_d2h"].median / rates["torch_d2h"].median, 3),
            "store_acquire": round(store["gib_per_s"]["median"] / torch_both.median, 3),
            "h2d_waiting_each": round(
                rates["tier_h2d_waiting_each"].median / rates["torch_h2d"].median, 3)},
    }


def _store_moves(layout: KVLayout, n: int, repeats: int) -> dict[str, Any]:
    """`KVStore.acquire` of n pages that are on the host tier while n others fill the device
    tier: each acquired page is promoted (host -> device), one of the others demoted."""
    tiers = [TierConfig("device", n * layout.page_bytes),
             TierConfig("host", 2 * n * layout.page_bytes)]
    with KVStore(layout, tiers, device="cuda") as store:
        keys = [secrets.token_bytes(16) for _ in range(2 * n)]
        pages = torch.randn((n, *layout.page_shape), device="cuda").to(layout.dtype)
        store.put(keys[:n], pages)
        store.put(keys[n:], pages)  # the first n are demoted to the host tier
        halves = [keys[:n], keys[n:]]
        turn = [0]

        def acquire_the_other_half() -> None:
            with store.acquire(halves[turn[0]]) as lease:
                assert len(lease) == n, "a page went missing"
            turn[0] ^= 1

        before = store.stats()
        seconds = alternate({"acquire": _timed(acquire_the_other_half)}, repeats)["acquire"]
        after = store.stats()
    calls = repeats + 1
    promoted = sum(after[t]["promotions"] - before[t]["promotions"] for t in ("device", "host"))
    demoted = sum(after[t]["demotions"] - before[t]["demotions"] for t in ("device", "host"))
    per_call = (promoted + demoted) / calls * layout.page_bytes
    return {"promotions_per_call": promoted / calls, "demotions_per_call": demoted / calls,
            "gib_per_s": _gib_per_s(int(per_call), seconds).to_json(2),
            "ms_per_call": seconds.map(lambda s: s * 1e3).to_json(2)}


@contextlib.contextmanager
def _receiver(arena: Segment) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "perf._gpu_receiver", arena.name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        if proc.stdout.read(1) != b"r":
            raise RuntimeError(f"the receiver did not start (exit {proc.wait(30)})")
        yield proc
        _send(proc, b"q", b"", answer=False)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _send(proc: subprocess.Popen[bytes], kind: bytes, body: bytes, *,
          answer: bool = True) -> tuple[float, float] | None:
    """Send one message; the receiver's answer (value read, its own seconds) if `answer`."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(HEADER.pack(kind, len(body)) + body)
    proc.stdin.flush()
    if not answer:
        return None
    data = proc.stdout.read(ANSWER.size)
    if len(data) != ANSWER.size:
        raise RuntimeError(f"the receiver died (exit {proc.wait(30)})")
    return ANSWER.unpack(data)


def ipc_handoff(layout: KVLayout, nbytes: int, repeats: int) -> dict[str, Any]:
    """Leased CUDA pages to a second process: by IPC handle vs through pinned shared memory."""
    n = nbytes // layout.page_bytes
    moved = n * layout.page_bytes
    keys = [secrets.token_bytes(16) for _ in range(n)]
    with KVStore(layout, [TierConfig("device", moved)], device="cuda") as store:
        store.put(keys, torch.randn((n, *layout.page_shape), device="cuda").to(layout.dtype))
        arena = Segment.create(f"omni-{secrets.token_hex(8)}-gpucheck", moved)
        try:
            arena.pin()
            shared = arena.tensor(0, (moved,), torch.uint8)
            with store.acquire(keys) as lease, _receiver(arena) as proc:
                pages = lease.pages()  # [n, *page_shape]: a view of the device tier
                last_value = float(pages.reshape(-1)[-1])
                last_byte = float(pages.reshape(-1).view(torch.uint8)[-1])
                handles: list[int] = []
                parts: dict[str, list[float]] = {"pack": [], "open_and_read": []}

                def by_handle() -> float:
                    start = time.perf_counter()
                    packed = pack_value(pages, cuda_ipc=True)
                    packed_at = time.perf_counter()
                    got, theirs = _send(proc, b"i", packed.body)
                    seconds = time.perf_counter() - start
                    assert not packed.buffers and got == last_value, (got, last_value)
                    handles.append(len(packed.body))
                    parts["pack"].append(packed_at - start)
                    parts["open_and_read"].append(theirs)
                    return seconds

                def by_copy() -> float:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    shared.copy_(pages.reshape(-1).view(torch.uint8), non_blocking=True)
                    torch.cuda.synchronize()
                    got, _ = _send(proc, b"c", b"")
                    seconds = time.perf_counter() - start
                    assert got == last_byte, (got, last_byte)
                    return seconds

                first = by_handle()  # the receiver opens this memory for the first time
                seconds = alternate({"ipc": by_handle, "copy": by_copy}, repeats)
        finally:
            arena.close()
    ms = {name: s.map(lambda x: x * 1e3) for name, s in seconds.items()}
    return {"bytes": moved, "pages": n, "handle_bytes": max(handles),
            "ms": {name: s.to_json(3) for name, s in ms.items()},
            "first_handle_ms": round(first * 1e3, 3),
            # where a handoff's time goes: packing here, opening and reading there (the rest
            # is the pipe between the two processes)
            "ipc_parts_ms": {name: Samples(tuple(v[1:])).map(lambda x: x * 1e3).to_json(3)
                             for name, v in parts.items()},
            "copy_gib_per_s": _gib_per_s(moved, seconds["copy"]).to_json(2),
            "speedup": round(ms["copy"].median / ms["ipc"].median, 1)}


async def stage_value(nbytes: int, repeats: int) -> dict[str, Any]:
    """A CUDA tensor of `nbytes` as a stage's argument to a worker of this host (one head, one
    worker, CLI subprocesses): by CUDA IPC handle (the default) vs through host memory
    (``OMNI_CUDA_IPC=0`` in the driver: device -> host, the payload mover's shared memory,
    host -> the worker's GPU). The node only reads the last element, on its GPU."""
    import tempfile

    import omni
    from omni.transport.movers import payload_mover
    from perf import _gpu_nodes as nodes
    from perf._procs import CliProcess, wait_members

    with tempfile.TemporaryDirectory(prefix="omni-gpu-check-") as tmp:
        folder, token = Path(tmp), str(Path(tmp) / "cluster.token")
        procs = [CliProcess(["cluster", "start", "--bind", "tcp://127.0.0.1:*",
                             "--token-file", token], folder)]
        try:
            address = procs[0].wait_line(r"head at (tcp://\S+)").group(1)
            procs.append(CliProcess(["cluster", "join", address, "--token-file", token,
                                     "--name", "gpu"], folder))
            procs[1].wait_line(r"joined .* as")
            wait_members(address, token, {"gpu": procs[1]}, cwd=folder)
            async with omni.Runtime(cluster=address, token_file=token) as rt:
                await rt.deploy(nodes.Receive)
                return await _time_stage_value(rt, nodes.Receive(), payload_mover(), nbytes,
                                               repeats)
        finally:
            for proc in reversed(procs):
                proc.stop()


async def _time_stage_value(rt: Any, node: Any, mover: Any, nbytes: int,
                            repeats: int) -> dict[str, Any]:
    value = torch.randn(nbytes // 4, device="cuda")
    expected = {"device": "cuda:0", "last": float(value[-1])}
    frames = {"ipc": 0, "host": 0}
    times: dict[str, list[float]] = {"ipc": [], "host": []}
    saved = os.environ.get("OMNI_CUDA_IPC")

    async def once(mode: str, keep: bool) -> None:
        os.environ["OMNI_CUDA_IPC"] = "1" if mode == "ipc" else "0"
        sent = mover.stats()["frames_out"] + mover.stats()["shm_out"]
        start = time.perf_counter()
        out = await rt.run(node, value=value)
        seconds = time.perf_counter() - start
        assert out == expected, (out, expected)
        if keep:
            times[mode].append(seconds)
            frames[mode] += mover.stats()["frames_out"] + mover.stats()["shm_out"] - sent

    try:
        for mode in times:
            await once(mode, keep=False)
        for r in range(repeats):
            for mode in (list(times) if r % 2 == 0 else reversed(list(times))):
                await once(mode, keep=True)
    finally:
        if saved is None:
            os.environ.pop("OMNI_CUDA_IPC", None)
        else:
            os.environ["OMNI_CUDA_IPC"] = saved
    ms = {mode: Samples(tuple(t)).map(lambda s: s * 1e3) for mode, t in times.items()}
    return {"bytes": value.nbytes, "ms": {mode: s.to_json(3) for mode, s in ms.items()},
            "payloads_sent": {mode: n / repeats for mode, n in frames.items()},
            "speedup": round(ms["host"].median / ms["ipc"].median, 1)}
