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
Understand = omni.node(where="w1")(Cosmos3Understand.cls)
Paint = omni.node(where="w2")(Cosmos3Paint.cls)
RayUnderstand = omni.node(resources={"node_a": 1})(Cosmos3Understand.cls)
RayPaint = omni.node(resources={"node_b": 1})(Cosmos3Paint.cls)


@omni.graph
def cosmos3_split(prompt: str, out: str, seed: int = 0):
    path = check_out(out, False)
    understood = Understand(folder=FOLDER)(prompt, "blurry", 32, 24, 4.0, "")
    painted = Paint(folder=FOLDER)(understood, 32, 24, 3, 4.0, seed)
    return save_png(painted, path, False)


@omni.graph
def cosmos3_split_ray(prompt: str, out: str, seed: int = 0):
    path = check_out(out, False)
    understood = RayUnderstand(folder=FOLDER)(prompt, "blurry", 32, 24, 4.0, "")
    painted = RayPaint(folder=FOLDER)(understood, 32, 24, 3, 4.0, seed)
    return save_png(painted, path, False)
