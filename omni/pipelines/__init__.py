"""Pipelines: each model family's graph as library code, built from a model folder.

A pipeline composes the graph DSL (`omni.graph`), the engines (`omni.compute`) and the OpenAI
endpoint marks (`omni.serve.openai`) into a graph that ``omni run`` and ``omni serve`` run as
they run a graph file's: `z_image_graph` for a Z-Image folder (diffusers' layout). Nodes that
any image pipeline shares (`check_out`, `write_file`) live here too.
"""

from omni.pipelines._files import check_out, write_file
from omni.pipelines.z_image import z_image_graph

__all__ = ["check_out", "write_file", "z_image_graph"]
