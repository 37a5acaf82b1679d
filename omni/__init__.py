"""Omni: one runtime for multimodal inference pipelines.

Three layers, each a package: `omni.graph` (Control Flow: the DSL and the scheduler),
`omni.kv` (Data Flow: the paged KV store) with `omni.transport` (the wire), and
`omni.compute` (Compute Flow: prompts, prefix keys, sampling, engines); `omni.cluster` places
class nodes on workers above them, plugged in by `omni.runtime`. This module only
re-exports the public API; importing it does not import torch.
"""

from omni.errors import OmniError
from omni.graph import (
    Balancer,
    CacheSalt,
    Context,
    Graph,
    GraphError,
    InputError,
    InputFile,
    Node,
    NodeError,
    OutputFile,
    Ref,
    RouteError,
    context,
    graph,
    node,
    run,
    switch,
)
from omni.runtime import AsyncioRuntime, Runtime

__version__ = "0.1.0"

__all__ = [
    "AsyncioRuntime",
    "Balancer",
    "CacheSalt",
    "Context",
    "Graph",
    "GraphError",
    "InputError",
    "InputFile",
    "Node",
    "NodeError",
    "OmniError",
    "OutputFile",
    "Ref",
    "RouteError",
    "Runtime",
    "context",
    "graph",
    "node",
    "run",
    "switch",
]
