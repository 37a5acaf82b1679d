"""Z-Image's library pipeline with its text side and its diffusion side pinned to two
different workers, for `omni run --cluster`: a request's conditions travel from one to the
other, and the text side's cached prefixes stay in the first one's store. ``z_image_split``
pins them by worker name (a hand-joined cluster's "w1" and "w2"); ``z_image_split_ray`` by the
custom resources of the test Ray cluster's two nodes (``node_a``, ``node_b``). ``OMNI_MODEL``
names the Z-Image folder (read by the driver; the nodes get it as an argument). The nodes are
the library's."""

import os

import omni
from omni.pipelines import check_out, save_png
from omni.pipelines.z_image import ZImageCondition, ZImagePaint

FOLDER = os.environ.get("OMNI_MODEL", "")


def split(name: str, text: dict, paint: dict) -> omni.Graph:
    """The graph `name`: the text side placed by `text`'s node options, the diffusion side by
    `paint`'s."""
    condition = omni.node(**text)(ZImageCondition.cls)
    painter = omni.node(**paint, concurrency=8)(ZImagePaint.cls)

    def graph(prompt: str, out: str, seed: int = 0):
        path = check_out(out, False)
        conditions = condition(folder=FOLDER)(prompt, "blurry", 4.0, "")
        painted = painter(folder=FOLDER)(conditions, None, 0.6, 32, 32, 2, 4.0, seed)
        return save_png(painted, path, False)

    return omni.graph(graph, name=name)


z_image_split = split("z_image_split", {"where": "w1"}, {"where": "w2"})
z_image_split_ray = split("z_image_split_ray", {"resources": {"node_a": 1}},
                          {"resources": {"node_b": 1}})
