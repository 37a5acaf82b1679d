"""The processes perf/footprint.py measures: the image example as Omni runs it, and its roles as
separate services would run them. Each function here is the whole life of one child process
(spawned, so nothing of the parent's memory is in it) and returns one `RoleRun` record.

- `omni_image`: the example's graph (examples/image_generation.py, loaded from its file with
  ``OMNI_MODEL`` set) on an `omni.Runtime` whose KV store this process builds: every role of
  the graph on one engine (one copy of the weights) and one store (one copy of the prompt's
  KV).
- `llm_image_service`, `diffusion_service`: the image pipeline's two roles as two services,
  each loading its own copy of the weights and keeping its own store (the prefix cache an LLM
  server and a diffusion server each keep). The diffusion service computes the prompt's KV
  itself (its store starts empty) and caches it there.

Every store is built here with explicit tiers and passed explicitly (`store=`), so what each
variant keeps does not depend on the engine's defaults.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PAGE_SIZE = 16  # the examples' page size

__all__ = ["RoleRun", "Spec", "diffusion_service", "llm_image_service", "omni_image",
           "proc_status"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What every child process of one run needs (picklable: it crosses to spawned children).
    Why one record: every variant must run the very same requests on the very same model."""

    model_dir: str  # a Hugging Face folder (config.json, model.safetensors, tokenizer.json)
    prompt: str  # the image's text prompt
    width: int  # pixels
    height: int
    steps: int
    guidance: float
    seed: int
    expand: int  # tokens the LLM role writes before the image
    store_capacity: str  # each store's device tier
    threads: int  # torch intra-op threads in each child


@dataclass(slots=True)
class RoleRun:
    """One child process's figures. Why a record: the parent sums them per variant."""

    role: str
    kv_pages: int  # pages resident in this process's store(s) at the end
    page_bytes: int
    rss_after_imports: int  # VmRSS once the process imported what it runs, before any work
    rss_peak: int  # VmHWM: the peak RSS of this process alone
    ru_maxrss: int  # bytes; includes the parent's RSS at the fork before exec (see footprint)
    memory_end: dict[str, int]  # VmRSS and its parts at the end
    seconds: float
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.page_bytes


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM and VmRSS's parts (RssAnon, RssFile, RssShmem) of this process, in bytes.

    VmHWM is this address space's peak RSS: unlike ``ru_maxrss`` it starts again at exec, so a
    spawned child's figure does not carry its parent's RSS at the fork."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[name] = int(value.split()[0]) * 1024  # reported in kB
    return out


def _start(spec: Spec) -> tuple[float, int]:
    """Set the child's torch threads; note when it started and its RSS after the imports."""
    import torch

    if spec.threads > 0:
        torch.set_num_threads(spec.threads)
    return time.perf_counter(), proc_status()["VmRSS"]


def _finish(role: str, started: tuple[float, int], stores: list[Any],
            outputs: dict[str, Any]) -> RoleRun:
    pages = sum(sum(tier["pages"] for name, tier in store.stats().items()
                    if name in ("device", "host")) for store in stores)
    page_bytes = stores[0].layout.page_bytes if stores else 0
    status = proc_status()  # with the stores' pages still mapped
    for store in stores:
        store.close()
    return RoleRun(role, pages, page_bytes, started[1], status["VmHWM"],
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   {k: status[k] for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")},
                   time.perf_counter() - started[0], outputs)


def _store(spec: Spec) -> Any:
    """A store of one device tier in the model's page layout (read from its config.json)."""
    import torch

    from omni.compute.models import DecoderConfig
    from omni.kv import KVStore, TierConfig

    config = DecoderConfig.from_hf(json.loads((Path(spec.model_dir) / "config.json").read_text()))
    layout = config.kv_layout(PAGE_SIZE, torch.float32)
    return KVStore(layout, [TierConfig("device", spec.store_capacity)])


def _load_example(name: str, spec: Spec) -> ModuleType:
    """examples/<name>.py as a module, with ``OMNI_MODEL`` pointing at the run's model."""
    os.environ["OMNI_MODEL"] = spec.model_dir
    path = EXAMPLES / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"footprint_{name}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up by name
    module_spec.loader.exec_module(module)
    return module


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pixels(png: bytes) -> Any:
    """The [H, W, 3] uint8 pixels of a PNG."""
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))


# -- the image pipeline ----------------------------------------------------------------------


def omni_image(spec: Spec) -> RoleRun:
    """examples/image_generation.py's graph on one runtime: LLM role and diffusion role share
    one engine and one store."""
    import trio

    import omni

    example = _load_example("image_generation", spec)
    started = _start(spec)
    store = _store(spec)
    assert store.layout == example.KV_LAYOUT

    async def run(out: str) -> dict[str, Any]:
        async with omni.Runtime(kv=store, graphs=[example.image_generation]) as rt:
            return await rt.run(example.image_generation, prompt=spec.prompt, out=out,
                                width=spec.width, height=spec.height, steps=spec.steps,
                                guidance=spec.guidance, seed=spec.seed, expand=spec.expand)

    with tempfile.TemporaryDirectory(prefix="omni-footprint-") as folder:
        result = trio.run(run, str(Path(folder) / "image.png"))
        png = Path(result["out"]).read_bytes()
    llm = result["llm"]
    return _finish("omni", started, [store], {
        "png_sha256": _digest(png), "pixels": _pixels(png),
        "expansion_text": result["expansion"], "expansion_tokens": result["expansion_tokens"],
        "prompt_tokens": llm["prompt_tokens"], "llm_cached_tokens": llm["cached_tokens"],
        "diffusion_prompt_tokens": result["prompt_tokens"],
        "diffusion_tokens_reused": result["prompt_tokens_reused"],
        "kv_bytes_resident_reported": result["kv_bytes_resident"],
        "kv_bytes_separate_reported": result["kv_bytes_separate"]})


def llm_image_service(spec: Spec) -> RoleRun:
    """The LLM role as its own service: its weights, its store; returns the expansion."""
    import trio

    from omni.compute import Prompt, SamplingParams, Text, TorchEngine

    started = _start(spec)
    store = _store(spec)  # its own prefix cache, as an LLM server keeps
    engine = TorchEngine.from_pretrained(spec.model_dir, page_size=PAGE_SIZE, store=store)
    params = SamplingParams(max_new_tokens=spec.expand, temperature=0)
    result = trio.run(engine.generate, Prompt([Text(spec.prompt)]), params)
    return _finish("llm", started, [store], {
        "expansion": list(result.token_ids), "expansion_text": result.text or "",
        "expansion_tokens": len(result.token_ids), "prompt_tokens": result.prompt_tokens,
        "llm_cached_tokens": result.cached_tokens})


def diffusion_service(spec: Spec, expansion: list[int]) -> RoleRun:
    """The diffusion role as its own service: its own copy of the weights and its own store,
    empty at first, so it computes the prompt's KV itself (and caches it)."""
    import trio

    from omni.compute import ImageGenerator, Prompt, Text, TorchEngine
    from omni.compute.diffusion import to_png

    started = _start(spec)
    store = _store(spec)
    engine = TorchEngine.from_pretrained(spec.model_dir, page_size=PAGE_SIZE, store=store)
    generator = ImageGenerator(engine, seed=0)  # as the example's `Paint`
    prompt = Prompt([Text(spec.prompt)]) + Text(tuple(expansion)) if expansion else (
        Prompt([Text(spec.prompt)]))

    async def paint() -> Any:
        return await generator.generate(prompt, height=spec.height // 8, width=spec.width // 8,
                                        steps=spec.steps, guidance=spec.guidance,
                                        seed=spec.seed, reuse=True)

    result = trio.run(paint)
    return _finish("diffusion", started, [store], {
        "png_sha256": _digest(to_png(result.image)), "pixels": result.image,
        "diffusion_prompt_tokens": result.prompt_tokens,
        "diffusion_tokens_reused": result.prompt_tokens_reused})
