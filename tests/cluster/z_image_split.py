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
Condition = omni.node(where="w1")(ZImageCondition.cls)
Paint = omni.node(where="w2", concurrency=8)(ZImagePaint.cls)
RayCondition = omni.node(resources={"node_a": 1})(ZImageCondition.cls)
RayPaint = omni.node(resources={"node_b": 1}, concurrency=8)(ZImagePaint.cls)


@omni.graph
def z_image_split(prompt: str, out: str, seed: int = 0):
    path = check_out(out, False)
    conditions = Condition(folder=FOLDER)(prompt, "blurry", 4.0, "")
    painted = Paint(folder=FOLDER)(conditions, None, 0.6, 32, 32, 2, 4.0, seed)
    return save_png(painted, path, False)


@omni.graph
def z_image_split_ray(prompt: str, out: str, seed: int = 0):
    path = check_out(out, False)
    conditions = RayCondition(folder=FOLDER)(prompt, "blurry", 4.0, "")
    painted = RayPaint(folder=FOLDER)(conditions, None, 0.6, 32, 32, 2, 4.0, seed)
    return save_png(painted, path, False)
