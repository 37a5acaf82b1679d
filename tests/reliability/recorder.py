"""The rows the reliability suite records: one per case, written as JSON when the session ends.

Why JSON in an ignored place: `make test` runs this suite too and must not touch the tracked
tree; `python -m tests.reliability.table` reads the file and renders the README table.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tests.reliability.cases import CASES

__all__ = ["ENV", "Recorder", "Row", "default_path", "read_rows"]

ENV = "OMNI_RELIABILITY_JSON"  # where to write the rows (default: the pytest cache)


@dataclass(frozen=True)
class Row:
    """One case as it ran: how many times it was exercised and what came of it."""

    key: str
    area: str
    case: str
    tries: int
    outcome: str


class Recorder:
    """Collects rows; each case is recorded once per session."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def record(self, key: str, *, tries: int, outcome: str) -> None:
        if key not in CASES:
            raise KeyError(f"unknown reliability case {key!r}: add it to tests/reliability/"
                           "cases.py")
        if key in self.rows:
            raise ValueError(f"reliability case {key!r} recorded twice")
        if not isinstance(tries, int) or tries < 1:
            raise ValueError(f"{key}: tries must be a positive int, got {tries!r}")
        if not outcome or "|" in outcome or "\n" in outcome:
            raise ValueError(f"{key}: an outcome is one line of text without '|'")
        area, case = CASES[key]
        self.rows[key] = Row(key, area, case, tries, outcome)

    def write(self, path: Path) -> None:
        order = list(CASES)
        rows = sorted(self.rows.values(), key=lambda r: order.index(r.key))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


def default_path(config: Any | None = None) -> Path:
    """$OMNI_RELIABILITY_JSON, else the pytest cache (ignored by git), else the temp dir."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("reliability")) / "rows.json"
    return Path(tempfile.gettempdir()) / "omni-reliability.json"


def read_rows(path: Path) -> list[Row]:
    return [Row(**row) for row in json.loads(path.read_text())]
