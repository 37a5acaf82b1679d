"""The public API is fixed: tests and users depend on these names."""

import subprocess
import sys

import omni


def test_public_names_are_pinned():
    assert sorted(omni.__all__) == sorted([
        "AsyncioRuntime", "Balancer", "CacheSalt", "Context", "Graph", "GraphError", "InputError",
        "InputFile", "Node", "NodeError", "OmniError", "OutputFile", "Ref", "RouteError",
        "Runtime", "context", "graph", "node", "run", "switch",
    ])
    for name in omni.__all__:
        assert getattr(omni, name) is not None


def test_errors_form_one_family():
    for error in (omni.GraphError, omni.NodeError, omni.RouteError, omni.InputError):
        assert issubclass(error, omni.OmniError)
    assert issubclass(omni.RouteError, omni.NodeError)


def test_importing_omni_does_not_import_torch():
    """`omni run` starts fast: the top-level package must not pull in torch."""
    code = "import sys, omni; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
