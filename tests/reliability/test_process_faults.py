"""Workers SIGKILLed, as real processes: one holding shared-memory leases of this process's
store, one serving `kv.fetch` to this process when it dies. Leases of the dead expire and
their pages become evictable; a fetch in flight is a miss; no page stored is another key's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch
import trio

from omni._shm import shm_directory
from omni.cluster.kv.peers import FetchReply, FetchRequest, PeerFetcher, serve_kv
from omni.kv import KVLeaseError, open_descriptor
from omni.transport import RPCClient, RPCServer
from omni.transport.movers import host_id, unpack
from tests._wait import CAP_S, wait_until
from tests.reliability._support import (
    LAYOUT,
    check_pages,
    keys_for,
    make_store,
    pages_of,
)

ROOT = Path(__file__).resolve().parents[2]
# Seconds a descriptor handed to the child lives: the test checks all three are still pinned
# after three round trips to the child (milliseconds each), and only then waits them out.
TTL = 5.0

HOLDER = textwrap.dedent("""
    import sys, time, msgspec, torch
    from omni.kv import PageDescriptor, open_descriptor
    from tests.reliability._support import check_pages, keys_for
    print("ready", flush=True)
    held = []
    for line in sys.stdin:
        start, wire = line.split()
        desc = msgspec.msgpack.decode(bytes.fromhex(wire), type=PageDescriptor)
        pages = open_descriptor(desc)
        check_pages(keys_for(2, start=int(start), extra="killed"), torch.stack(list(pages)))
        held.append(pages)
        print("holding", len(held), flush=True)
""")


def child(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)


@pytest.mark.proc  # SIGKILL of a lease holder
def test_a_worker_killed_while_holding_leases(lease_clock, record):
    with make_store(device=8, host=8) as store:
        proc = child(HOLDER)
        try:
            assert proc.stdout.readline().strip() == "ready"
            descriptors, held = [], []
            for i in range(3):
                keys = keys_for(2, start=2 * i, extra="killed")
                store.put(keys, pages_of(keys))
                with store.acquire(keys) as lease:
                    descriptors.append(lease.descriptor(ttl=TTL))
                held += keys
                proc.stdin.write(f"{2 * i} {msgspec.msgpack.encode(descriptors[-1]).hex()}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == f"holding {i + 1}"
            assert store.stats()["leases"]["pinned_pages"] == 6
            proc.kill()  # SIGKILL: no chance to give anything back
            assert proc.wait(10) == -9
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        # Until the leases expire their pages stay pinned; the store serves everything else.
        others = keys_for(2, start=100, extra="killed")
        store.put(others, pages_of(others))
        with store.acquire(others) as lease:
            check_pages(others, lease.pages())
        lease_clock.advance(max(0, max(d.expiry_ns for d in descriptors) - lease_clock()) / 1e9)
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
        # Now evictable: new pages push every one of them out.
        fresh = keys_for(16, start=200, extra="killed")
        store.put(fresh, pages_of(fresh))
        assert not any(store.match([k]) for k in held) and store.match(fresh) == 16
        for d in descriptors:  # a late reader gets a miss, never the new pages
            with pytest.raises(KVLeaseError):
                open_descriptor(d)
        with store.acquire(fresh[-2:]) as lease:  # its lease record is used again...
            new = lease.descriptor(ttl=30)
        [reused] = [d for d in descriptors if d.lease_slot == new.lease_slot]
        with pytest.raises(KVLeaseError, match="unknown or was released"):
            open_descriptor(reused)  # ... and the old descriptor still opens nothing
        with open_descriptor(new) as pages:
            check_pages(fresh[-2:], torch.stack(list(pages)))
    record("proc.lease_holder_killed", tries=len(descriptors),
           outcome=f"{len(descriptors)} leases of the killed worker expired after their ttl "
                   f"({TTL:g} s): pages unpinned and evicted by new ones; its descriptors "
                   "then refused, never another page")


SERVER = textwrap.dedent("""
    import trio
    from omni.transport import RPCServer
    from omni.cluster.kv.peers import FetchRequest, make_fetch_handler
    from tests.reliability._support import keys_for, make_store, pages_of

    keys = keys_for(8, extra="transfer")
    store = make_store(16, 16)
    store.put(keys, pages_of(keys))
    real = make_fetch_handler(store)

    async def fetch(request):
        if request.keys[0] == keys[4]:  # lease the pages, then die before replying
            store.acquire(request.keys)
            print("mid-transfer", flush=True)
            await trio.sleep_forever()
        return await real(request)

    async def main():
        server = RPCServer()
        server.register("kv.fetch", fetch, body_type=FetchRequest)
        async with server:
            print(server.endpoint, store.store_id, flush=True)
            await trio.sleep_forever()

    trio.run(main)
""")


class OneHolder:
    def best_source(self, keys, exclude=()):
        return ("w", len(keys))


@pytest.mark.proc  # SIGKILL mid-transfer
async def test_a_worker_killed_mid_transfer(record):
    keys = keys_for(8, extra="transfer")
    proc = child(SERVER)
    shm = shm_directory()
    holder_id = None
    try:
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        endpoint, holder_id = line.split()
        with make_store(16, 16) as requester, contextlib.ExitStack() as opened:
            # 0.5 s beats: the holder, another process, may be starved for a while on a loaded
            # machine and still be alive; its death is noticed after 1.5 s of silence.
            async with RPCClient(endpoint, heartbeat_interval=0.5) as client:
                # 1. The first half travels as a descriptor of the holder's shared memory,
                # opened here while the holder lives (once it is dead, a store starting
                # anywhere on the machine may reclaim its shared memory).
                reply = await client.call_with_payload(
                    "kv.fetch", FetchRequest(keys[:4], host_id(), os.getpid()), timeout=CAP_S,
                    result_type=FetchReply)
                received = opened.enter_context(unpack(reply.body.header, reply.payload,
                                                       LAYOUT))
                # 2. The second half: the holder dies while serving it.
                fetcher = PeerFetcher(OneHolder(), {"w": client}.get, "me", layout=LAYOUT,
                                      timeout=CAP_S)
                got = []
                async with trio.open_nursery() as nursery:
                    async def fetch() -> None:
                        got.append(await fetcher.fetch(requester, keys[4:],
                                                       recompute_page_s=None))

                    nursery.start_soon(fetch)
                    assert (await trio.to_thread.run_sync(proc.stdout.readline)).strip() == (
                        "mid-transfer")
                    proc.kill()
                # 3 missed beats ended the fetch, not its timeout
                assert (client.stats().peer_gone, client.stats().timeouts) == (1, 0)
                assert got == [0] and requester.keys() == []  # a miss: nothing stored
                assert fetcher.stats()["failures"] == 1
                assert await fetcher.fetch(requester, keys, recompute_page_s=None) == 0
            # 3. The descriptor opened before the death still maps the holder's pages: its
            # lease lives on, the memory outlives the process; they are the right pages.
            assert received.put_into(requester) == 4
            opened.close()
            # 4. A healthy holder serves the rest; the requester holds only its own pages.
            with make_store(16, 16) as healthy:
                healthy.put(keys, pages_of(keys))
                server = RPCServer()
                serve_kv(server, healthy, host_id="another-machine")
                async with server, RPCClient(server.endpoint) as client:
                    fetcher = PeerFetcher(OneHolder(), {"w": client}.get, "me", layout=LAYOUT,
                                          host_id="another-machine")
                    assert await fetcher.fetch(requester, keys[4:], recompute_page_s=None) == 4
            with requester.acquire(keys[:4]) as a, requester.acquire(keys[4:]) as b:
                check_pages(keys[:4], a.pages())
                check_pages(keys[4:], b.pages())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if holder_id is not None:  # a SIGKILLed owner cannot unlink its shared memory
            for path in shm.glob(f"omni-{holder_id}-*"):
                path.unlink()
    record("proc.holder_killed_mid_transfer", tries=2,
           outcome="the fetch in flight was a miss within 3 heartbeats (nothing stored, "
                   "recomputed or fetched from a healthy worker); a descriptor handed over "
                   "before the kill still gave its own pages")


OWNER = textwrap.dedent("""
    import trio
    from tests.reliability._support import make_store

    store = make_store(4, 4)
    print(store.store_id, flush=True)
    trio.run(trio.sleep_forever)
""")

STARTS_A_STORE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
    from tests.reliability._support import make_store

    print("imported", flush=True)
    sys.stdin.readline()  # the owners die now: the store starts right after
    make_store(4, 4).close()
""")


@pytest.mark.proc  # dead owners' shared memory reclaimed
def test_a_store_that_starts_reclaims_the_shared_memory_of_killed_owners(record, tmp_path,
                                                                         monkeypatch):
    """Store owners SIGKILLed cannot unlink their arenas and lease tables; the next store to
    start on the machine removes them, says so in one line, and leaves live owners' alone.

    In a shared-memory folder of the test's own (``OMNI_SHM_DIR``, inherited by the children):
    in /dev/shm any other process's first store, another test run's included, may reclaim the
    dead owners' files first, and the store started here would have nothing left to say."""
    monkeypatch.setenv("OMNI_SHM_DIR", str(tmp_path))
    owners = [child(OWNER) for _ in range(3)]
    starter = subprocess.Popen([sys.executable, "-c", STARTS_A_STORE], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        ids = [proc.stdout.readline().split()[0] for proc in owners]
        files = {i: sorted(p.name for p in shm_directory().glob(f"omni-{i}-*")) for i in ids}
        assert all(len(names) == 3 for names in files.values()), files  # 2 arenas, 1 table
        assert starter.stdout.readline().strip() == "imported"
        for proc in owners[:2]:
            proc.kill()
            proc.wait(10)
        _, err = starter.communicate("start\n", timeout=120)
        assert starter.returncode == 0, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("WARNING removed the shared memory"), \
            lines
        assert all(f"omni-{i}" in lines[0] for i in ids[:2]) and ids[2] not in lines[0]
        for i in ids[:2]:
            assert not list(shm_directory().glob(f"omni-{i}-*"))
        assert sorted(p.name for p in shm_directory().glob(f"omni-{ids[2]}-*")) == files[ids[2]]
    finally:
        for proc in [*owners, starter]:
            proc.kill()
            proc.wait(10)
    record("proc.owner_killed", tries=3,
           outcome="2 owners SIGKILLed: the next store to start removed their 6 arenas and "
                   "lease tables and said so in one line; the live owner's 3 were left alone")


MEMBER = textwrap.dedent("""
    import os, trio
    from omni.transport import RPCServer
    from tests.reliability._support import make_store

    async def main():
        store = make_store(4, 4)
        async with RPCServer("tcp://127.0.0.1:*") as server:  # answers the head's heartbeats
            print(store.store_id, server.endpoint, flush=True)
            await trio.sleep_forever()

    trio.run(main)
""")


@pytest.mark.proc  # a store-owning cluster member SIGKILLed
async def test_a_lost_member_s_shared_memory_is_reclaimed_by_the_head_at_once(
        record, tmp_path, monkeypatch):
    """Two members of a head, on its host, each own a KV store; one is SIGKILLed (and left
    unreaped, as a supervisor that has not waited yet leaves it). Once the head finds it lost
    it removes that member's arenas and lease table, with no store starting anywhere; the
    live member's files stay. In a shared-memory folder of the test's own, as above."""
    await lost_member_reclaimed("head", tmp_path, monkeypatch)
    record("proc.owner_lost_head", tries=1,
           outcome="the head found the SIGKILLed member lost and at once removed its 3 arenas "
                   "and lease table, no store starting; the live member's 3 were left alone")


@pytest.mark.proc  # a store-owning cluster member SIGKILLed
async def test_a_lost_member_s_shared_memory_is_reclaimed_by_a_roster_of_its_host(
        record, tmp_path, monkeypatch):
    """As above, the head taking no part (as one on another host does): a driver's or
    worker's roster on the member's host sees it leave and removes its files."""
    await lost_member_reclaimed("roster", tmp_path, monkeypatch)
    record("proc.owner_lost_roster", tries=1,
           outcome="the head elsewhere, a roster of the host saw the SIGKILLed member leave "
                   "and at once removed its 3 arenas and lease table, no store starting; the "
                   "live member's 3 were left alone")


async def lost_member_reclaimed(finder: str, tmp_path, monkeypatch) -> None:
    """Two store-owning members of a head, one SIGKILLed: its files go once the `finder`
    ("head", or a "roster" with the head's own reclaim off) knows, the other's stay."""
    from omni.cluster import head as head_module
    from omni.cluster.head import Head
    from omni.cluster.membership import Roster
    from omni.cluster.protocol import MemberInfo, MemberLoad, Register
    from omni.transport.credentials import Credentials

    monkeypatch.setenv("OMNI_SHM_DIR", str(tmp_path))
    if finder == "roster":
        monkeypatch.setattr(head_module, "reclaim_dead_owners", lambda why: 0)
    members = [child(MEMBER) for _ in range(2)]
    try:
        lines = [(await trio.to_thread.run_sync(proc.stdout.readline)).split()
                 for proc in members]
        store_ids, endpoints = [line[0] for line in lines], [line[1] for line in lines]

        def files(store_id: str) -> list[str]:
            return sorted(p.name for p in shm_directory().glob(f"omni-{store_id}-*"))

        kept = files(store_ids[1])
        assert len(files(store_ids[0])) == len(kept) == 3  # 2 arenas, 1 lease table
        head = Head(Credentials(None), "tcp://127.0.0.1:*", heartbeat_interval=0.2)
        with trio.fail_after(CAP_S):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(head.run)
                async with RPCClient(address) as client:
                    for i, proc in enumerate(members):
                        info = MemberInfo(f"w{i}", endpoints[i], host_id(), proc.pid)
                        await client.call("cluster.register", Register(info, MemberLoad()))
                    roster = Roster(client, interval=0.2)
                    seen: list[list[str]] = []
                    nursery.start_soon(roster.run, lambda now: seen.append(sorted(now)))
                    await wait_until(lambda: seen == [["w0", "w1"]])
                    os.kill(members[0].pid, 9)  # SIGKILL, not reaped
                    await wait_until(lambda: seen[-1] == ["w1"])
                    assert [v.state for v in head.members()] == ["up", "lost"]
                    assert files(store_ids[0]) == [] and files(store_ids[1]) == kept
                    nursery.cancel_scope.cancel()
    finally:
        for proc in members:
            proc.kill()
            proc.wait(10)
