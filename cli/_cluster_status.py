"""How ``omni cluster status`` shows the members: a table, or one JSON object."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import typer

__all__ = ["member_row", "print_status"]

COLUMNS = ("NAME", "STATE", "ADDRESS", "CPU", "GPU", "REPLICAS", "KV PAGES", "KV HIT RATE",
           "REQUESTS")


def member_row(view: Any) -> dict[str, Any]:
    """One member's figures: what the table shows and ``--json`` prints."""
    load = view.load
    kv = {tier: counters for tier, counters in load.kv.items()
          if tier not in ("leases", "peers")}
    hits = sum(c.get("hits", 0) for c in kv.values())
    misses = max((c.get("misses", 0) for c in kv.values()), default=0)
    nodes: dict[str, int] = {}
    for node, _ in load.deployments.values():
        nodes[node] = nodes.get(node, 0) + 1
    return {
        "name": view.info.name, "state": view.state, "address": view.info.rpc,
        "pid": view.info.pid, "since": view.since,
        "resources": view.info.resources, "kv_capacity_bytes": view.info.kv_capacity,
        "replicas": nodes,
        "kv": {tier: {"pages": c.get("pages", 0), "capacity": c.get("capacity", 0)}
               for tier, c in kv.items()},
        "kv_hits": hits, "kv_misses": misses,
        "kv_hit_rate": hits / (hits + misses) if hits + misses else None,
        "kv_peer_fetches": load.kv.get("peers", {}),
        "requests": load.requests, "failed": load.failed,
    }


def print_status(address: str, members: list[Any], *, as_json: bool,
                 token_file: str | None = None) -> None:
    """The members as a table (or one JSON object); with none, the command that adds one
    (with `token_file` when the status was asked with one)."""
    rows = [member_row(view) for view in members]
    if as_json:
        typer.echo(json.dumps({"head": address, "members": rows,
                               "time": time.time()}, default=_plain))
        return
    up = sum(1 for r in rows if r["state"] == "up")
    typer.echo(f"cluster at {address}: {up} worker(s) up"
               + (f", {len(rows) - up} lost" if len(rows) > up else ""))
    if not rows:
        flag = f" --token-file {token_file}" if token_file else ""
        typer.echo(f"no workers: start one with `omni cluster join {address}{flag}`")
        return
    table = [COLUMNS, *(_cells(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    for row in table:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        typer.echo("  ".join(cells).rstrip())


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    replicas = ", ".join(f"{n}×{c}" if c > 1 else n for n, c in sorted(r["replicas"].items()))
    pages = " ".join(f"{tier} {c['pages']}/{c['capacity']}" for tier, c in r["kv"].items())
    rate = "-" if r["kv_hit_rate"] is None else f"{100 * r['kv_hit_rate']:.0f}%"
    return (r["name"], r["state"], r["address"], f"{r['resources'].get('cpu', 0):g}",
            f"{r['resources'].get('gpu', 0):g}", replicas or "-", pages or "-", rate,
            f"{r['requests']} ({r['failed']} failed)" if r["failed"] else str(r["requests"]))


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value)
