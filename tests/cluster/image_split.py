"""examples/image_generation.py with its language model stage pinned to worker "w1" and its
diffusion stage to worker "w2", for `omni run --cluster`: the prompt's KV pages that the first
computes must follow the request to the second. The nodes are the example's own classes."""

import importlib.util
import sys
from pathlib import Path

import omni

_spec = importlib.util.spec_from_file_location(
    "image_generation", Path(__file__).resolve().parents[2] / "examples" / "image_generation.py")
assert _spec is not None and _spec.loader is not None
example = sys.modules.setdefault("image_generation", importlib.util.module_from_spec(_spec))
if not hasattr(example, "image_generation"):  # not loaded yet (its dataclasses need the entry)
    _spec.loader.exec_module(example)

KV_LAYOUT = example.KV_LAYOUT
Understand = omni.node(where="w1", concurrency=8)(example.Understand.cls)
Paint = omni.node(where="w2")(example.Paint.cls)


@omni.graph
def image_split(prompt: str, out: str):
    settings = example.check_settings(128, 128, 8, 3.0, 0, 8)
    references = example.read_reference("")
    path = example.check_out(out, False)
    understood = Understand()(prompt, references, settings)
    painted = Paint()(understood, settings, True)
    return example.write_png(painted, path, False)
