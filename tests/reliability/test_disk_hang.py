"""A disk that hangs (a network file system gone away, a dying drive) under a running store: a
write of a page being demoted, or a read of a page being promoted, does not return. The rest of
the store must go on serving: other threads' `match`, `acquire` of resident pages and `stats`
complete while the disk call is provably still parked, and once it returns every page is its
own."""

from __future__ import annotations

from tests.kv._gates import CAP, Gate, Worker
from tests.reliability._support import check_pages, keys_for, make_store, pages_of

KEYS = keys_for(8, extra="hang")


def serve_others_while_parked(store, gate: Gate, busy: Worker, resident: list[bytes]) -> int:
    """Reads of `resident` pages from this thread while `busy` waits on the parked `gate`;
    how many completed (all of them, or the case fails)."""
    busy.start()
    assert gate.parked.wait(CAP), "the disk call was never made"
    served = 0
    for _ in range(50):
        assert store.match(resident) == len(resident)
        with store.acquire(resident) as lease:
            check_pages(resident, lease.pages())
        assert store.stats()["leases"]["open"] == 0
        served += 3
    assert not gate.returned and busy.is_alive(), "the disk call returned too early to tell"
    gate.go.set()
    busy.finish()
    return served


def test_a_hanging_disk_does_not_stall_the_store(tmp_path, record):
    k = KEYS
    served = 0
    with make_store(device=4, host=2, disk=8, path=tmp_path) as store:
        for key in k[:6]:  # device: k2..k5, host: k0 k1
            store.put([key], pages_of([key]))
        gate = Gate("pwritev")
        with gate.patch():  # k2 makes way for k6; k0 makes way for k2 on disk: its write hangs
            served += serve_others_while_parked(
                store, gate, Worker(lambda: store.put([k[6]], pages_of([k[6]]))), k[4:6])
        store.put([k[7]], pages_of([k[7]]))  # device: k4..k7, host: k2 k3, disk: k0 k1
        store.discard([k[7]])  # a free device slot: k0 comes up without evicting anything
        gate = Gate("preadv")
        with gate.patch():  # k0 comes back from disk: its read hangs
            served += serve_others_while_parked(
                store, gate, Worker(lambda: store.acquire([k[0]]).release()), k[4:6])
        live = k[:7]
        assert store.match(live) == len(live)
        with store.acquire(live[:4]) as lease:
            check_pages(live[:4], lease.pages())
        with store.acquire(live[4:]) as lease:
            check_pages(live[4:], lease.pages())
        assert store.stats()["disk"]["write_errors"] == 0
    record("disk.hang", tries=served,
           outcome=f"{served}/{served} match, acquire and stats calls of other threads "
                   "completed while a demotion's disk write, then a promotion's disk read, "
                   "hung; once they returned all 7 pages were their own")
