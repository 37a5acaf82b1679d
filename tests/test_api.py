"""The public API is fixed: tests and users depend on these names."""


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
