"""A machine at full CPU load: twice as many busy processes as cores beside a peer and its
caller. A healthy peer that answers late must not be declared gone (the calls and the
heartbeats all arrive, only slower), and one that really stops (SIGSTOP) must still be found
out, and welcomed back when it resumes. What is counted is outcomes, never how fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from omni.transport import RPCClient

ROOT = Path(__file__).resolve().parents[2]

ECHO_SERVER = textwrap.dedent("""
    import trio
    from omni.transport import RPCServer

    async def echo(body: int) -> int:
        return body

    async def main():
        server = RPCServer()
        server.register("echo", echo)
        async with server:
            print(server.endpoint, flush=True)
            await trio.sleep_forever()

    trio.run(main)
""")

INTERVAL = 0.2  # heartbeats often, so that a load-induced miss would have many chances
CAP = 120.0  # seconds a condition may take under load before the case fails


async def wait_for(predicate, what: str) -> None:
    with trio.move_on_after(CAP):
        while not predicate():
            await trio.sleep(INTERVAL / 2)
        return
    raise AssertionError(f"not within {CAP:.0f} s under load: {what}")


@pytest.mark.proc  # SIGSTOP of a peer process
async def test_a_loaded_machine_tells_a_slow_peer_from_a_stopped_one(record):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 1))]
    server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        endpoint = (await trio.to_thread.run_sync(server.stdout.readline)).strip()
        async with RPCClient(endpoint, heartbeat_interval=INTERVAL,
                             missed_heartbeats=3) as client:
            answered, seen_gone = 0, 0
            for i in range(100):  # calls and idle spells: heartbeats carry the quiet ones
                assert await client.call("echo", i) == i
                answered += 1
                seen_gone += not client.peer_alive
                if i % 20 == 0:
                    for _ in range(10):
                        await trio.sleep(INTERVAL / 2)
                        seen_gone += not client.peer_alive
            assert (answered, seen_gone) == (100, 0)

            os.kill(server.pid, signal.SIGSTOP)
            await wait_for(lambda: not client.peer_alive, "a stopped peer declared gone")
            os.kill(server.pid, signal.SIGCONT)
            await wait_for(lambda: client.peer_alive, "a resumed peer declared back")
            assert await client.call("echo", -1) == -1
    finally:
        for proc in [server, *burners]:
            proc.kill()
            proc.wait(30)
    record("peer.loaded", tries=100,
           outcome=f"with {len(burners)} busy processes on {os.cpu_count()} cores: 100/100 "
                   "calls answered around 5 idle spells of 5 heartbeats, the peer never "
                   "declared gone; SIGSTOPped, it was declared gone, and back once resumed")
