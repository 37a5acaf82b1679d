"""The Wire layer's import rules: nothing unpickled from the network, no higher layer, no torch
at import time (tests/test_layering.py checks that in a fresh interpreter)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("__init__.py", "errors.py", "wire.py", "trio_zmq.py", "rpc.py")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_sockets_codec_and_rpc_never_import_pickle_or_a_higher_layer():
    for name in MODULES:
        imported = imported_modules(ROOT / "omni" / "transport" / name)
        assert not {m for m in imported if "pickle" in m}, name
        assert not {m for m in imported if m.startswith(("omni.graph", "omni.compute"))}, name
