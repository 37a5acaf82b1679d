"""Pipelines: each model family's graph as library code, built from a model folder.

A pipeline composes the graph DSL (`omni.graph`), the engines (`omni.compute`) and the OpenAI
endpoint marks (`omni.serve.openai`) into a graph that ``omni run`` and ``omni serve`` run as
they run a graph file's: `image_graph` for a diffusers image folder (`z_image_graph` for a
Z-Image folder, `cosmos3_graph` for a Cosmos3 one). Nodes that any image pipeline shares
(`check_out`, `read_pixels`, `save_png`, `write_file`) live here too.
"""

from pathlib import Path

from omni.compute.image_families import image_family
from omni.graph import Graph
from omni.pipelines._files import check_out, read_pixels, save_png, write_file
from omni.pipelines.cosmos3 import cosmos3_graph
from omni.pipelines.z_image import z_image_graph

__all__ = ["check_out", "cosmos3_graph", "image_graph", "read_pixels", "save_png",
           "write_file", "z_image_graph"]


def image_graph(folder: str | Path, name: str) -> Graph:
    """The library's graph `name` for the diffusers image folder `folder`, by its family.

    Raises:
        ValueError: not a folder of a family Omni serves (`image_family`), naming the ones
            it serves.
    """
    build = {"z_image": z_image_graph, "cosmos3": cosmos3_graph}[image_family(folder)]
    return build(folder, name)
