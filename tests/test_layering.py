"""The layers' import rules, over the whole import graph (imports inside functions too):
each layer imports only the layers below it, the two at the top side by side import neither
each other, and no package's modules import each other in a cycle (a package's __init__
counts as a module that imports what it imports)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# From the bottom up; a module may import its own layer's package and any layer below it.
LAYERS: list[tuple[str, ...]] = [
    ("omni.errors", "omni._shm", "omni._units", "omni._openmp", "omni._parking"),
    ("omni.kv",),
    ("omni.transport",),
    ("omni.compute",),
    ("omni.graph",),
    ("omni.cluster", "omni.serve"),  # side by side: neither imports the other
    ("omni.pipelines",),  # each family's graph: the DSL, the engines and the endpoint marks
    ("omni.runtime",),
    ("omni",),
    ("cli",),
]


def package_of(module: str) -> str | None:
    """The layer entry (package or module name) `module` belongs to, or None if not ours."""
    best = None
    for layer in LAYERS:
        for name in layer:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best)):
                best = name
    return best


def rank(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, *, type_checking: bool = True) -> set[str]:
    """Our modules `path` imports, anywhere in it (those under ``if TYPE_CHECKING:`` only
    with `type_checking`: they are never imported when the program runs)."""
    tree = ast.parse(path.read_text())
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if package_of(n) is not None}


def our_modules() -> dict[str, Path]:
    files = [*ROOT.glob("omni/**/*.py"), *ROOT.glob("cli/**/*.py")]
    return {module_name(p): p for p in files}


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, path in our_modules().items():
        home = package_of(module)
        assert home is not None, f"{module} belongs to no layer: add it to LAYERS"
        for imported in imports_of(path):
            target = package_of(imported)
            if target == "omni" and imported != "omni":
                continue  # `omni.x` for a module of no layer of its own is caught above
            if target == home:
                continue
            if rank(target) >= rank(home):
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def test_no_package_has_an_import_cycle() -> None:
    modules = our_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        names = imports_of(path, type_checking=False)
        for imported in names:
            if modules.get(imported, path).name == "__init__.py" and any(
                    n.startswith(imported + ".") and n in modules for n in names):
                continue  # `from pkg import module`: what is imported is the module
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]  # `from pkg.mod import name`
            if imported and imported != module and package_of(imported) == package_of(module):
                edges[module].add(imported)  # a package's __init__ too: it imports its modules
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    assert cycles == []


# What a light entry point must not load, checked in order in one fresh interpreter (each
# check before any later import could load it): `omni run`, a cluster head and a worker start
# without torch (the mover loads it for KV pages only), the OpenAI marks are importable by a
# graph file without it, and xgrammar loads only when a request is constrained.
LIGHT_IMPORTS = [("omni", "torch"), ("omni.transport", "torch"),
                 ("omni.transport.movers", "torch"), ("omni.cluster.worker", "torch"),
                 ("omni.cluster.kv.directory", "torch"), ("omni.cluster.kv.events", "torch"),
                 ("omni.serve.openai", "torch"), ("omni.compute", "xgrammar")]


@pytest.mark.proc  # a fresh interpreter's sys.modules: nothing imported before the check
def test_light_entry_points_import_no_heavy_library() -> None:
    code = ("import importlib, json, sys\n"
            f"checks = {LIGHT_IMPORTS!r}\n"
            "loaded = []\n"
            "for module, heavy in checks:\n"
            "    importlib.import_module(module)\n"
            "    loaded.append([module, heavy, heavy in sys.modules])\n"
            "print(json.dumps(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[module, heavy, False] for module, heavy in LIGHT_IMPORTS]
