"""Control Flow: the pipeline DSL, build-time validation, the trio scheduler and replicas.

Layering inside: `dsl` traces graph bodies, `validate` checks them, `_plan` compiles them,
`scheduler` runs one request of a plan, `balance` places calls on replicas, `runtime` ties
these together and `embed` runs them from synchronous or asyncio code.
"""

from omni.graph.balance import Balancer, CallInfo, LeastLoaded, PowerOfTwo, Replica, RoundRobin
from omni.graph.context import Context, context
from omni.graph.dsl import Graph, Node, NodeClass, Ref, graph, node, switch
from omni.graph.embed import AsyncioRuntime, run
from omni.graph.errors import GraphError, InputError, NodeError, RouteError
from omni.graph.marks import CacheSalt, InputFile, OutputFile, file_role, is_cache_salt
from omni.graph.runtime import ResultStream, Runtime, RuntimeStats

__all__ = [
    "AsyncioRuntime", "Balancer", "CacheSalt", "CallInfo", "Context", "Graph", "GraphError",
    "InputError", "InputFile", "LeastLoaded", "Node", "NodeClass", "NodeError", "OutputFile",
    "PowerOfTwo", "Ref", "Replica", "ResultStream", "RoundRobin", "RouteError", "Runtime",
    "RuntimeStats", "context", "file_role", "graph", "is_cache_salt", "node", "run", "switch",
]
