"""Cosmos3's library pipeline with its understanding side and its generation side pinned to
two different workers, for `omni run --cluster`: a request's understanding keys and values
travel from one to the other, and its cached prefixes (the shared system prompt) stay in the
first one's store. ``cosmos3_split`` pins them by worker name ("w1", "w2");
``cosmos3_split_ray`` by the test Ray cluster's node resources (``node_a``, ``node_b``).
``OMNI_MODEL`` names the Cosmos3 folder (read by the driver). The nodes are the library's."""

import os

import omni
from omni.pipelines import check_out, save_png
from omni.pipelines.cosmos3 import Cosmos3Paint, Cosmos3Understand

FOLDER = os.environ.get("OMNI_MODEL", "")


def split(name: str, understanding: dict, generation: dict) -> omni.Graph:
    """The graph `name`: the understanding side placed by `understanding`'s node options,
    the generation side by `generation`'s."""
    understand = omni.node(**understanding)(Cosmos3Understand.cls)
    paint = omni.node(**generation)(Cosmos3Paint.cls)

    def graph(prompt: str, out: str, seed: int = 0):
        path = check_out(out, False)
        understood = understand(folder=FOLDER)(prompt, "blurry", 32, 24, 4.0, "")
        painted = paint(folder=FOLDER)(understood, 32, 24, 3, 4.0, seed)
        return save_png(painted, path, False)

    return omni.graph(graph, name=name)


cosmos3_split = split("cosmos3_split", {"where": "w1"}, {"where": "w2"})
cosmos3_split_ray = split("cosmos3_split_ray", {"resources": {"node_a": 1}},
                          {"resources": {"node_b": 1}})
