"""A container's 64 MiB /dev/shm, for real: a private tmpfs of that size mounted over /dev/shm
in a mount namespace of a child process. The default `omni run` starts and serves there, and a
store configured for more than it holds fills it, then evicts: every page it serves is its
own, it says so in one warning line, and nothing dies of SIGBUS."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM_SIZE = "64m"
# `exec "$@"`: the command replaces the shell, so its exit status is the child's own (a SIGBUS
# shows as -7, not as a shell's 135).
_MOUNT = f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"'
_FORMS = (["unshare", "--user", "--map-root-user", "--mount"],  # any user, where allowed
          ["unshare", "--mount", "--propagation", "private"])  # root


@functools.cache
def _small_shm() -> tuple[str, ...]:
    """The argv prefix that runs a command with a private 64 MiB tmpfs at /dev/shm."""
    errors = []
    for form in _FORMS:
        argv = [*form, "sh", "-c", _MOUNT, "sh"]
        try:
            probe = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
        except FileNotFoundError as exc:
            errors.append(f"{' '.join(form)}: {exc}")
            continue
        if probe.returncode == 0:
            return tuple(argv)
        errors.append(f"{' '.join(form)}: {probe.stderr.strip() or probe.returncode}")
    pytest.fail("cannot mount a private 64 MiB /dev/shm for this test (it needs user "
                "namespaces, or root for a mount namespace): " + "; ".join(errors))


def _run_small(args: list[str], env: dict[str, str] | None = None, timeout: float = 300
               ) -> subprocess.CompletedProcess[str]:
    inherited = {k: v for k, v in os.environ.items() if k != "OMNI_SHM_DIR"}  # /dev/shm itself
    result = subprocess.run([*_small_shm(), *args], cwd=ROOT, capture_output=True, text=True,
                            env={**inherited, **(env or {})}, timeout=timeout)
    assert result.returncode != -signal.SIGBUS, f"died of SIGBUS:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# The store as a child process: its host tier (256 MiB) is four times the tmpfs; pages come
# from their keys (the oracle); prints what it saw as one JSON line.
STORE = textwrap.dedent('''
    import hashlib, json, logging, os, sys, tempfile
    import torch
    from omni.kv import KVLayout, KVStore, TierConfig, block_keys
    from omni._shm import shm_directory

    # 2 layers x K,V x 16 tokens x 4 heads x 64 dims, float32: 64 KiB pages
    LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_size=16,
                      dtype=torch.float32)
    NUM_PAGES = 2000  # 125 MiB

    def page_of(key):
        raw = bytearray(hashlib.shake_128(key).digest(LAYOUT.page_bytes))
        return torch.frombuffer(raw, dtype=torch.uint8)

    def same(page, key):
        return torch.equal(page.contiguous().view(torch.uint8).reshape(-1), page_of(key))

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("omni.kv").addHandler(handler)

    def used():
        info = os.statvfs(shm_directory())
        return (info.f_blocks - info.f_bfree) * info.f_frsize

    keys = block_keys(range(NUM_PAGES * 16), 16, extra=("small-shm",))
    with tempfile.TemporaryDirectory() as disk, KVStore(LAYOUT, [
            TierConfig("device", "16MiB"), TierConfig("host", "256MiB"),
            TierConfig("disk", "64MiB", path=disk)]) as store:
        out = {"fresh_used": used()}
        peak = 0
        for i in range(0, NUM_PAGES, 16):
            batch = keys[i:i + 16]
            pages = torch.stack([page_of(k).view(LAYOUT.dtype).view(LAYOUT.page_shape)
                                 for k in batch])
            store.put(batch, pages)
            peak = max(peak, used())
        out["recent_present"] = all(store.match([k]) for k in keys[-256:])
        served = wrong = missed = 0
        for key in keys:
            if not store.match([key]):
                missed += 1
                continue
            with store.acquire([key]) as lease:
                if len(lease) == 1:
                    served += 1
                    wrong += not same(lease.pages()[0], key)
        out.update(peak_used=peak, served=served, wrong=wrong, missed=missed,
                   stats=store.stats(), warnings=warnings)
    print(json.dumps(out))
''')


@pytest.mark.proc  # a 64 MiB /dev/shm in a mount namespace
def test_a_store_configured_beyond_a_small_shm_fills_it_then_evicts(record):
    result = _run_small([sys.executable, "-c", STORE])
    out = json.loads(result.stdout.strip().splitlines()[-1])
    stats, host = out["stats"], out["stats"]["host"]
    mib = 1 << 20
    assert out["fresh_used"] <= 9 * mib  # a step per memory tier, and the lease table
    assert out["wrong"] == 0 and out["served"] > 0 and out["recent_present"]
    assert out["served"] + out["missed"] == 2000
    assert host["capacity"] == 4096 and 0 < host["reserved"] < 1024  # under 64 MiB
    assert host["pages"] <= host["reserved"] and host["evictions"] > 0
    assert stats["device"]["reserved"] == stats["device"]["capacity"] == 256
    assert stats["disk"]["pages"] > 0  # evicted host pages went down, as from a full tier
    [line] = out["warnings"]
    assert line.startswith(f"KV host tier: no room left in /dev/shm, so it holds "
                           f"{host['reserved']} pages")
    assert "--shm-size" in line and "--kv-host" in line
    record("shm.small", tries=2000,
           outcome=f"a 256 MiB host tier in a 64 MiB /dev/shm grew to {host['reserved']} "
                   f"pages of 64 KiB ({out['peak_used'] / mib:.0f} MiB used at most), then "
                   "evicted to disk as a full tier does and said so in one warning line with "
                   f"the fix; {out['served']} pages served, all their own, the other "
                   f"{out['missed']} misses; no SIGBUS")


@pytest.mark.proc  # a 64 MiB /dev/shm in a mount namespace
def test_the_default_dialogue_run_starts_and_serves_in_a_64_mib_shm(record, tmp_path):
    """The default tiers (a 256 MiB device tier, a 1 GiB host tier) take /dev/shm as pages
    arrive, so `omni run` fits where reserving them whole could not start."""
    turns = ROOT / "examples" / "dialogue_turns.jsonl"
    result = _run_small([sys.executable, "-m", "cli", "run", "examples/omni_dialogue.py",
                         "--inputs-json", str(turns), "--json"],
                        env={"OMNI_DIALOGUE_OUT": str(tmp_path)})
    lines = [json.loads(line)["output"] for line in result.stdout.splitlines()]
    assert len(lines) == len(turns.read_text().splitlines()) > 0
    for turn in lines:
        assert turn["generated_tokens"] > 0 and Path(turn["wav"]).stat().st_size > 44
    assert any(turn["cached_tokens"] > 0 for turn in lines)  # sessions reused their pages
    record("shm.small_run", tries=len(lines),
           outcome=f"{len(lines)}/{len(lines)} turns of examples/omni_dialogue.py served by "
                   "`omni run` with its default KV tiers (256 MiB device, 1 GiB host) in a "
                   "64 MiB /dev/shm, later turns from cached pages; exit 0")
