"""A machine at full CPU load, for tests that must hold on one: twice as many busy-loop
processes as cores, started for a block and killed as it ends.

Why a helper: a behaviour that holds only on an idle machine (a peer's heartbeats answered in
time, a transfer done before a deadline) fails where the suite runs beside other work. A test
that runs its behaviour inside `saturated_cpu` shows that it does not depend on idle cores;
what it asserts is outcomes, never how fast. Such a test starts processes: mark it ``proc``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["saturated_cpu"]


@contextlib.contextmanager
def saturated_cpu(per_core: int = 2) -> Iterator[int]:
    """Run `per_core` busy-loop processes per core for the block; yields how many run. They
    are killed and reaped as the block ends, however it ends."""
    burners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(per_core * (os.cpu_count() or 1)):
            burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield len(burners)
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
