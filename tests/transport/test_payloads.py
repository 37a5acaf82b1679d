"""Out-of-band buffers between processes: shared memory with leases on one host, zero-copy
frames between hosts, and transfers in chunks for buffers larger than one frame."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from omni._shm import shm_directory
from omni.transport.errors import WireError
from omni.transport.movers import SHM_MIN, PayloadMover, PayloadTooLarge
from omni.transport.values import pack_value, unpack_value
from tests._load import saturated_cpu


@pytest.fixture
def movers():
    producer, consumer = PayloadMover(shm=True), PayloadMover(shm=True)
    yield producer, consumer
    producer.close()
    consumer.close()


def send(producer: PayloadMover, consumer: PayloadMover, value, *, same_host: bool = True):
    packed = pack_value(value)
    refs, frames = producer.pack(packed.buffers, peer="consumer", same_host=same_host)
    return refs, unpack_value(packed.body, consumer.unpack(refs, frames, peer="producer"))


def segments(mover: PayloadMover) -> list[str]:
    return [p.name for p in Path(shm_directory()).glob(f"{mover._prefix}-*")]


def test_same_host_values_arrive_through_shared_memory_without_frames(movers) -> None:
    producer, consumer = movers
    array = np.random.default_rng(0).random((512, 512))
    tensor = torch.arange(1 << 18, dtype=torch.int32)
    refs, back = send(producer, consumer, {"a": array, "t": tensor})
    assert [r.frames for r in refs] == [0, 0] and all(r.segment for r in refs)
    assert (back["a"] == array).all() and torch.equal(back["t"], tensor)
    back["a"][0, 0] = -1.0  # writable, and the producer's array is untouched
    assert array[0, 0] != -1.0


def test_a_lease_ends_when_the_last_view_or_tensor_goes_and_the_segment_is_reused(movers):
    producer, consumer = movers
    _, back = send(producer, consumer, np.ones(SHM_MIN, np.uint8))
    view = back[10:20]
    tensor = torch.from_numpy(back[100:])
    del back
    gc.collect()
    assert consumer.take_releases("producer") == []  # a view and a tensor still hold it
    del view
    gc.collect()
    assert consumer.take_releases("producer") == []
    del tensor
    gc.collect()
    released = consumer.take_releases("producer")
    assert len(released) == 1 and producer.stats()["leased"] == 1
    producer.release("consumer", released)
    assert producer.stats()["leased"] == 0
    send(producer, consumer, np.zeros(SHM_MIN, np.uint8))
    assert producer.stats()["segments_created"] == 1  # the same segment, written again


def test_a_leased_segment_is_never_reused(movers) -> None:
    producer, consumer = movers
    _, first = send(producer, consumer, np.full(SHM_MIN, 1, np.uint8))
    _, second = send(producer, consumer, np.full(SHM_MIN, 2, np.uint8))
    assert (first == 1).all() and (second == 2).all()
    assert producer.stats()["segments_created"] == 2


def test_a_release_from_another_peer_or_an_unknown_lease_is_ignored(movers) -> None:
    producer, consumer = movers
    refs, back = send(producer, consumer, np.ones(SHM_MIN, np.uint8))
    producer.release("someone else", [refs[0].lease])
    producer.release("consumer", [12345])
    assert producer.stats()["leased"] == 1
    producer.forget("consumer")  # the consumer is gone: its leases end
    assert producer.stats()["leased"] == 0
    del back


def test_a_forgotten_peer_leaves_nothing_leased_pooled_or_mapped_and_keeps_its_arrays(movers):
    """What a worker does when a driver leaves (or stops renewing): the segments the driver
    still held are unlinked, not pooled for another peer (the driver may still read them),
    and the worker's mappings of the driver's segments go (the driver unlinked them)."""
    producer, consumer = movers
    _, held = send(producer, consumer, np.full(SHM_MIN, 3, np.uint8))  # the result it kept
    _, args = send(producer, consumer, np.full(SHM_MIN, 4, np.uint8))
    del args
    gc.collect()
    producer.release("consumer", consumer.take_releases("producer"))  # one returned, one held
    assert producer.stats()["leased"] == 1 and len(segments(producer)) == 2
    assert consumer.stats()["mapped_bytes"] == 2 * SHM_MIN
    producer.forget("consumer")  # the held segment is unlinked; the returned one is pooled
    assert producer.stats()["leased"] == 0 and len(segments(producer)) == 1
    assert (held == 3).all()  # still mapped, still its bytes
    consumer.unmap("producer")  # what a driver does with a worker's segments as it stops
    assert consumer.stats()["mapped_bytes"] == 0 and consumer._maps == {}
    _, again = send(producer, consumer, np.full(SHM_MIN, 5, np.uint8))  # reuses the free one
    assert producer.stats()["segments_created"] == 2 and (held == 3).all() and (again == 5).all()
    consumer.forget("producer")  # forget drops the mappings too
    assert consumer.stats()["mapped_bytes"] == 0 and consumer._maps == {}


def test_shrink_unlinks_the_free_segments_of_the_pool_and_keeps_leased_ones(movers):
    producer, consumer = movers
    _, kept = send(producer, consumer, np.ones(SHM_MIN, np.uint8))
    _, done = send(producer, consumer, np.ones(2 * SHM_MIN, np.uint8))
    del done
    gc.collect()
    producer.release("consumer", consumer.take_releases("producer"))
    assert len(segments(producer)) == 2
    assert producer.shrink() == 1
    assert len(segments(producer)) == 1 and producer.stats()["leased"] == 1
    assert (kept == 1).all()


def test_large_buffers_get_their_own_segment_unlinked_when_released(movers, monkeypatch):
    producer, consumer = movers
    monkeypatch.setattr("omni.transport.movers.POOL_MAX", SHM_MIN)
    _, back = send(producer, consumer, np.arange(SHM_MIN, dtype=np.uint16))
    assert (back == np.arange(SHM_MIN, dtype=np.uint16)).all()
    assert len(segments(producer)) == 1
    del back
    gc.collect()
    producer.release("consumer", consumer.take_releases("producer"))
    assert segments(producer) == []


def transfer(producer: PayloadMover, consumer: PayloadMover, ref) -> int:
    """Move `ref`'s chunks in order as the cluster does; how many chunks there were."""
    offset = count = 0
    while offset < ref.nbytes:
        chunk = producer.chunk_of("consumer", ref.transfer, offset)
        assert chunk.nbytes <= producer.chunk
        consumer.accept("producer", ref.transfer, ref.nbytes, offset, bytes(chunk))
        offset, count = offset + chunk.nbytes, count + 1
    return count


def test_between_hosts_a_buffer_over_one_chunk_is_a_transfer_taken_in_chunks():
    producer, consumer = PayloadMover(chunk=1 << 20), PayloadMover(chunk=1 << 20)
    array = np.arange((1 << 20) // 8 * 2 + 5, dtype=np.float64)  # three chunks
    small = np.ones(1 << 19, np.uint8)  # one frame
    packed = pack_value([array, small])
    refs, frames = producer.pack(packed.buffers, peer="consumer", same_host=False)
    assert [r.frames for r in refs] == [0, 1] and refs[0].transfer and len(frames) == 1
    assert producer.stats()["transfers"] == 1
    assert transfer(producer, consumer, refs[0]) == 3
    assert producer.stats()["transfers"] == 0  # the last chunk ended it
    back = unpack_value(packed.body, consumer.unpack(refs, frames, peer="producer"))
    assert (back[0] == array).all() and (back[1] == small).all()
    assert back[0].flags.writeable and consumer.stats()["transfers"] == 0


def test_a_transfer_out_of_order_incomplete_or_for_another_peer_is_a_wire_error():
    producer, consumer = PayloadMover(chunk=1 << 20), PayloadMover(chunk=1 << 20)
    packed = pack_value(np.zeros(3 << 20, np.uint8))
    refs, frames = producer.pack(packed.buffers, peer="consumer", same_host=False)
    tid, nbytes = refs[0].transfer, refs[0].nbytes
    with pytest.raises(WireError, match="no payload transfer"):
        producer.chunk_of("someone-else", tid, 0)
    with pytest.raises(WireError, match="not a chunk"):
        producer.chunk_of("consumer", tid, 5)
    with pytest.raises(WireError, match="began at offset"):
        consumer.accept("producer", tid, nbytes, 1 << 20, b"x" * (1 << 20))
    consumer.accept("producer", tid, nbytes, 0, b"x" * (1 << 20))
    with pytest.raises(WireError, match="does not follow"):  # a chunk skipped
        consumer.accept("producer", tid, nbytes, 2 << 20, b"x" * (1 << 20))
    with pytest.raises(WireError, match="did not arrive whole"):  # dropped by the bad chunk
        consumer.unpack(refs, frames, peer="producer")
    with pytest.raises(PayloadTooLarge, match="OMNI_PAYLOAD_MAX"):
        PayloadMover(max_bytes=1 << 20).accept("producer", 9, 2 << 20, 0, b"x")
    producer.forget("consumer")  # the peer is gone: its transfers go
    assert producer.stats()["transfers"] == 0


def test_with_shared_memory_off_everything_goes_as_frames() -> None:
    producer = PayloadMover(shm=False)
    packed = pack_value(np.ones(SHM_MIN * 2, np.uint8))
    refs, _ = producer.pack(packed.buffers, peer="consumer", same_host=True)
    assert refs[0].frames == 1 and producer.stats()["segments"] == 0


def test_frames_that_do_not_add_up_are_a_wire_error(movers) -> None:
    producer, consumer = movers
    packed = pack_value(np.ones(SHM_MIN, np.uint8))
    refs, frames = producer.pack(packed.buffers, peer="consumer", same_host=False)
    with pytest.raises(WireError):
        consumer.unpack(refs, [frames[0][:-1]], peer="producer")
    with pytest.raises(WireError):
        consumer.unpack(refs, [*frames, b"extra"], peer="producer")


def test_a_segment_name_from_outside_the_pool_is_refused(movers) -> None:
    _, consumer = movers
    from omni.transport.movers import BufferRef

    for name in ("../etc/passwd", "omni-pay-1/../../x", "omni-123-host"):
        with pytest.raises(WireError):
            consumer.unpack([BufferRef(16, segment=name, lease=1)], [], peer="producer")


def test_a_value_over_the_limit_is_refused_with_the_setting_named() -> None:
    producer = PayloadMover(shm=True, max_bytes=1 << 20)
    packed = pack_value(np.zeros(1 << 19))
    with pytest.raises(PayloadTooLarge, match="OMNI_PAYLOAD_MAX"):
        producer.pack(packed.buffers, peer="consumer", same_host=True)
    producer.close()


def test_close_unlinks_every_segment_and_mapped_arrays_stay_valid(movers) -> None:
    producer, consumer = movers
    _, back = send(producer, consumer, np.full(SHM_MIN, 7, np.uint8))
    assert segments(producer)
    producer.close()
    assert segments(producer) == []
    assert (back == 7).all()
    assert not any(name.startswith(producer._prefix) for name in os.listdir(shm_directory()))


@pytest.mark.proc  # a child killed and not yet reaped
def test_a_killed_process_not_yet_reaped_counts_as_dead() -> None:
    """A SIGKILLed process whose parent has not waited for it (a zombie) still has its pid,
    but runs no code and will unlink nothing: its segments are a dead owner's."""
    import signal
    import subprocess
    import sys

    from omni._shm import process_alive, process_start_time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = process_start_time(proc.pid)
        assert process_alive(proc.pid, started)
        os.kill(proc.pid, signal.SIGKILL)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, left unreaped
        assert not process_alive(proc.pid, started)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.proc  # dead owners' shared memory reclaimed
def test_segments_of_dead_processes_are_reclaimed_and_live_ones_kept(tmp_path, monkeypatch
                                                                    ) -> None:
    """In a shared-memory folder of the test's own: in /dev/shm another process (a test run
    beside this one) may reclaim the dead segment first."""
    import subprocess
    import sys

    monkeypatch.setenv("OMNI_SHM_DIR", str(tmp_path))

    from omni.transport.movers import reclaim_dead_segments

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    from omni._shm import owner_stamp, process_start_time

    folder = Path(shm_directory())
    dead = folder / f"omni-pay-{gone.stdout.strip()}-t1-deadbeef-1"
    live = folder / f"omni-pay-{owner_stamp()}-cafecafe-1"
    unstamped = folder / f"omni-pay-{os.getpid()}-cafecafe-2"  # a start time not known
    # this process's pid, but another start time: a process that had the pid before it
    reused = folder / f"omni-pay-{os.getpid()}-t{process_start_time(os.getpid()) + 1}-beef-1"
    for path in (dead, live, unstamped, reused):
        path.write_bytes(b"x")
    try:
        assert reclaim_dead_segments() == 2
        assert not dead.exists() and not reused.exists()
        assert live.exists() and unstamped.exists()
    finally:
        for path in (dead, live, unstamped, reused):
            path.unlink(missing_ok=True)


async def cross_a_curve_socket(*, heartbeat_interval: float = 1.0) -> None:
    """Send one frame of the largest size over a CURVE connection; its size comes back."""
    import trio

    from omni.transport.credentials import Credentials
    from omni.transport.rpc import Reply, RPCClient, RPCServer
    from omni.transport.security import ClusterToken
    from omni.transport.wire import MAX_PAYLOAD_BYTES

    async def size(_: object, payload: list) -> Reply:
        return Reply(sum(memoryview(f).nbytes for f in payload), [])

    frame = bytearray(MAX_PAYLOAD_BYTES)  # what a CHUNK-sized buffer travels as
    with Credentials(ClusterToken.generate()) as creds:
        server = RPCServer("tcp://127.0.0.1:*", ctx=creds.ctx, options=creds.server_options())
        server.register("size", size, body_type=object, with_payload=True)
        async with server:
            client = RPCClient(server.endpoint, ctx=creds.ctx, options=creds.client_options(),
                               timeout=60, heartbeat_interval=heartbeat_interval)
            async with client:
                with trio.fail_after(60):
                    assert await client.call("size", None, payload=[frame]) == len(frame)
                assert client.stats().peer_gone == 0


async def test_a_frame_of_the_largest_size_crosses_a_curve_socket() -> None:
    await cross_a_curve_socket()


@pytest.mark.proc  # busy processes beside it
async def test_the_largest_frame_crosses_a_curve_socket_with_every_core_busy() -> None:
    """The same with twice as many busy processes as cores. ZeroMQ encrypts and decrypts the
    frame in its I/O thread, and on a loaded machine that takes longer than the three
    heartbeats of silence after which a peer counts as gone (heartbeats here come three times
    as often as by default, so that it does on any machine): the server, busy receiving, is
    alive all along and must not be declared gone."""
    with saturated_cpu():
        await cross_a_curve_socket(heartbeat_interval=0.3)


def test_a_full_shared_memory_folder_is_an_error_naming_it_not_a_crash(movers, monkeypatch):
    """The segment's memory is reserved when it is made: with no room left the value fails
    to go, with the reason, instead of the process dying of SIGBUS when the copy touches
    memory that is not there; no file is left behind."""
    import errno

    producer, _ = movers

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve \d+ B for shared memory 'omni-pay-.*"
                                      r"--shm-size"):
        producer.pack(pack_value(np.ones(SHM_MIN, np.uint8)).buffers, peer="consumer",
                      same_host=True)
    assert segments(producer) == []
    assert producer.stats()["leased"] == 0
