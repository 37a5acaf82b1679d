"""The second process of `perf/gpu_check.py`'s page handoff: it receives KV pages from the
benchmark either by CUDA IPC handle or by a copy through pinned shared memory, and answers
with the value of the last element it sees on its GPU (so the sender checks the bytes came).

``python -m perf._gpu_receiver ARENA``; ARENA is the sender's shared-memory arena of the pages'
size, page-locked here too. On stdin, messages ``kind (1 byte) | length (8 bytes LE) | body``:

- ``i``: the body is `omni.transport.values.pack_value(pages, cuda_ipc=True)`'s body: open it
  (the sender's device memory, mapped) and read its last element;
- ``c``: the pages are in the arena: copy them onto this process's GPU, read the last byte;
- ``q``: quit.

Each answer is 16 bytes on stdout: the value read and the seconds this process took from
having the message to having the value, little-endian doubles. A received tensor is released
after the answer (the handoff is done once the receiver can read it). One byte ``r`` is
written first, once CUDA and the arena are ready.
"""

from __future__ import annotations

import struct
import sys
import time
from typing import BinaryIO

import torch

from omni._shm import Segment
from omni.transport.values import unpack_value

HEADER = struct.Struct("<cQ")
ANSWER = struct.Struct("<dd")


def read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError(f"the sender closed the pipe ({0 if not data else len(data)} of {n} B)")
    return data


def serve(arena_name: str, stdin: BinaryIO, stdout: BinaryIO) -> None:
    arena = Segment.attach(arena_name)
    arena.pin()
    host = arena.tensor(0, (arena.size,), torch.uint8)
    device = torch.empty(arena.size, dtype=torch.uint8, device="cuda")
    stdout.write(b"r")
    stdout.flush()
    while True:
        kind, length = HEADER.unpack(read_exact(stdin, HEADER.size))
        if kind == b"q":
            break
        body = read_exact(stdin, length)
        start = time.perf_counter()
        pages = None
        if kind == b"i":
            pages = unpack_value(body)
            value = float(pages.reshape(-1)[-1])  # a read on the GPU: the mapping works
        elif kind == b"c":
            device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            value = float(device[-1])
        else:
            raise ValueError(f"unknown message kind {kind!r}")
        stdout.write(ANSWER.pack(value, time.perf_counter() - start))
        stdout.flush()
        del pages  # lets the sender's memory go once the sender drops it too
    arena.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer)
