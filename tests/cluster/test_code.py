"""How a class node's code reaches a cluster worker: by module, file or shipped source."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from omni.cluster._code import CodeRef, code_ref, resolve

SOURCE = '''
import omni

@omni.node
class Greeter:
    def __init__(self, greeting: str = "hi"):
        self.greeting = greeting

    async def __call__(self, name: str) -> str:
        return f"{self.greeting} {name}"

if __name__ == "__main__":
    raise SystemExit("the main block must not run on a worker")
'''


def load(tmp_path: Path, name: str) -> object:
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_loaded_module_resolves_to_the_same_class(tmp_path: Path) -> None:
    module = load(tmp_path, "codemod_same")
    ref = code_ref(module.Greeter)
    assert ref.qualname == "Greeter" and ref.path == str(tmp_path / "codemod_same.py")
    assert resolve(ref) is module.Greeter


def test_shipped_source_loads_where_the_file_does_not_exist(tmp_path: Path) -> None:
    module = load(tmp_path, "codemod_shipped")
    ref = code_ref(module.Greeter)
    elsewhere = msgspec.structs.replace(ref, module="not_loaded_here",
                                        path=str(tmp_path / "gone" / "x.py"))
    cls = resolve(elsewhere)
    assert cls is not module.Greeter and cls.name == "Greeter"
    assert resolve(elsewhere) is cls  # loaded once per digest


def test_source_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    module = load(tmp_path, "codemod_digest")
    ref = code_ref(module.Greeter)
    forged = CodeRef(ref.module, ref.qualname, ref.path, ref.source + "\nx = 1\n", ref.digest)
    with pytest.raises(ValueError, match="does not match its digest"):
        resolve(forged)


def test_classes_defined_in_functions_cannot_travel() -> None:
    class Local:
        pass

    with pytest.raises(ValueError, match="defined inside a function"):
        code_ref(Local)


def test_a_module_of_a_package_loads_after_its_package(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A class node from a package's module whose package imports it back (as
    `omni.pipelines` imports its pipelines): the module is imported as Python imports it,
    its package first, not run alone under its name (which left the package half made)."""
    from omni.cluster._code import _digest

    package = tmp_path / "codepkg_loop"
    package.mkdir()
    (package / "__init__.py").write_text("from codepkg_loop.nodes import Greeter\n")
    (package / "_words.py").write_text('GREETING = "hello"\n')
    source = SOURCE.replace("import omni\n", "import omni\nfrom codepkg_loop._words import "
                            "GREETING\n")
    (package / "nodes.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = CodeRef("codepkg_loop.nodes", "Greeter", str(package / "nodes.py"), source,
                  _digest(source))
    try:
        cls = resolve(ref)
        assert cls is sys.modules["codepkg_loop.nodes"].Greeter
        assert sys.modules["codepkg_loop"].Greeter is cls
    finally:
        for name in ("codepkg_loop", "codepkg_loop.nodes", "codepkg_loop._words"):
            sys.modules.pop(name, None)
