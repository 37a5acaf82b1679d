"""Footprint: the image example as Omni runs it (roles sharing one KV copy) vs separate services.

The design's headline claim: a language model, its diffusion model and its speech decoder run
as nodes of one graph sharing one paged KV cache, instead of as separate services that each
keep their own copy. The image pipeline (examples/image_generation.py), run two ways with the
same request and outputs: the LLM role reads a long text prompt and writes a short expansion;
the diffusion role paints against prompt + expansion. **Omni**: the example's graph on one
`omni.Runtime`, both roles on one engine (one copy of the weights) and one store: the
diffusion role leases the LLM role's pages. **Separate**: an LLM service and a diffusion
service, each its own process loading its own copy of the weights and keeping its own store
(each server's prefix cache); the diffusion service computes the prompt's KV itself and
caches it. k = 2 roles hold the prompt's KV.

The dialogue (examples/omni_dialogue.py) is not measured: only its LLM attends to the
prompt's KV (the speech decoder turns token ids into audio and keeps none), so k = 1 and both
designs keep one copy by construction. "Omni's KV <= 1/1 of the separate services'" could not
fail, and a claim that cannot fail is not made. Nor is Qwen3-Omni's thinker and talker a
k = 2 case: the talker attends over its own model's KV of its own prompt and reads the
thinker through hidden states passed as stage values (as vLLM-Omni's and SGLang-Omni's stages
pass them), so neither design keeps a second copy of the thinker's KV to save.

Every variant's process is spawned (nothing of this process's memory in it) and runs the
request once; the separate services run one after the other, each in its own process, and
their figures add up (run side by side, as services are, they hold the same at once). Per
variant: resident KV bytes (pages in the stores at the end x page bytes, from
`KVStore.stats()`) and peak RSS (each process's VmHWM, summed): VmHWM, not ``ru_maxrss``,
because a spawned child's ``ru_maxrss`` starts from its parent's RSS at the fork before exec.
Also reported: RSS above each process's RSS right after its imports (the interpreter, torch
and the libraries a separate service pays again), so the saving of the copies themselves
shows apart from the processes'. Outputs must be equal (`outputs_equal`): the expansion
exactly and the image's pixels within one level of 8 bits (the separate diffusion service
computes the prompt's KV in another order of float sums than the LLM role's prefill;
`compare_outputs`), the PNG's bytes reported as they are.

Claims: KV bytes of Omni <= 1/k of the separate services' (k = 2, the roles that hold the
prompt's KV), and Omni's peak RSS below theirs. Order alternates over the repeats; one
untimed round first (not in --quick). Model: a random Llama (hidden 512, 8 layers, 8 heads,
4 KV heads, MLP 1536, vocab 512: ~26 M parameters, 16 KiB of KV per token) saved as a
Hugging Face folder with a byte-level tokenizer.json, which the example loads through
``OMNI_MODEL``. Torch threads: 1 per process.

Usage: ``python perf/footprint.py [--quick] [--repeats N] [--out PATH.json] [--plot PATH.png]``
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf import _footprint_roles as roles
from perf._common import Samples, claim, environment, plot_bars, write_json
from perf._footprint_roles import RoleRun, Spec

__all__ = ["Params", "main", "measure"]

MIB = 1 << 20
WORDS = ("a red fox in deep snow under pale light near the old stone wall where the river "
         "bends past tall pines while crows circle above quiet fields of frost and amber "
         "grass at dusk").split()
K = 2  # the roles that hold the prompt's KV: the LLM role and the diffusion role
PIXEL_TOLERANCE = 1  # levels of an 8-bit pixel (see `compare_outputs`)
COMPARED_ONLY = ("png_sha256", "pixels", "expansion",
                 "expansion_text")  # outputs compared, not reported


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = 3
    warmup: bool = True
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 512
    prompt_tokens: int = 2000  # the image prompt's characters (1 token each)
    width: int = 128
    height: int = 128
    steps: int = 8
    guidance: float = 3.0
    expand: int = 8
    store_capacity: str = "256MiB"
    threads: int = 1
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run: the tiny model, a short prompt, one round, no warm-up."""
        return cls(seed=seed, repeats=1, warmup=False, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, prompt_tokens=256, steps=2,
                   store_capacity="16MiB", quick=True)

    def model_overrides(self) -> dict[str, int]:
        names = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "vocab_size")
        return {name: getattr(self, name) for name in names}


# ---------------------------------------------------------------------------------------------
# The requests and the model


def _text(rng: random.Random, length: int) -> str:
    """Seeded words, exactly `length` characters (one byte-level token each)."""
    words: list[str] = []
    while len(" ".join(words)) < length:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:length]


def make_spec(params: Params, model_dir: str) -> Spec:
    """The request of a run, seeded: the image prompt and its sizes."""
    rng = random.Random(params.seed)
    return Spec(model_dir=model_dir, prompt=_text(rng, params.prompt_tokens), width=params.width,
                height=params.height, steps=params.steps, guidance=params.guidance,
                seed=params.seed, expand=params.expand, store_capacity=params.store_capacity,
                threads=params.threads)


def write_model(params: Params, folder: Path) -> dict[str, Any]:
    """A random Llama as a Hugging Face folder with a byte-level BPE tokenizer.json (token id
    = byte + 3, as the built-in tiny models; the other ids decode to ``<|id|>``); returns its
    figures."""
    import tokenizers
    import torch

    from omni.compute.models import save_pretrained, tiny_model

    model, config = tiny_model(seed=params.seed, **params.model_overrides())
    save_pretrained(model, config, folder)
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    vocab = {c: i + 3 for i, c in enumerate(sorted(byte_level.alphabet()))}
    # Every other id gets a text of its own, so that the expansion's text stands for its ids
    # (the image graph's result gives the expansion as text only).
    vocab.update({f"<|{i}|>": i for i in (*range(3), *range(3 + len(vocab), config.vocab_size))})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    layout = config.kv_layout(roles.PAGE_SIZE, torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    return {"architecture": config.architecture, **params.model_overrides(),
            "head_dim": config.head_dim, "dtype": "float32", "parameters": parameters,
            "weight_bytes": parameters * 4, "page_size": roles.PAGE_SIZE,
            "page_bytes": layout.page_bytes,
            "kv_bytes_per_token": layout.page_bytes // roles.PAGE_SIZE}


# ---------------------------------------------------------------------------------------------
# Running the variants


def _child(fn: Callable[..., RoleRun], *args: Any) -> RoleRun:
    """`fn(*args)` in a fresh spawned process."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def run_variant(variant: str, spec: Spec) -> list[RoleRun]:
    """One variant: its processes' records."""
    if variant == "omni":
        return [_child(roles.omni_image, spec)]
    llm = _child(roles.llm_image_service, spec)
    return [llm, _child(roles.diffusion_service, spec, llm.outputs["expansion"])]


def _outputs(runs: list[RoleRun]) -> dict[str, Any]:
    """A variant's outputs, its processes' merged."""
    return {k: v for r in runs for k, v in r.outputs.items()}


def compare_outputs(reps: list[list[RoleRun]]) -> dict[str, Any]:
    """Every repeat of both variants against the first: the expansion exactly (its text: every
    id has its own, see `write_model`) and the image's pixels within `PIXEL_TOLERANCE` levels.
    Why a tolerance: the LLM role's pages come from the engine's prefill and decode steps, the
    separate diffusion service computes the same KV in one forward pass; float32 sums in
    another order move a latent by ~1e-6, which can cross a rounding boundary of an 8-bit
    pixel. Wrong KV would change the whole image."""
    ref, others = _outputs(reps[0]), [_outputs(rep) for rep in reps[1:]]
    diffs = [np.abs(o["pixels"].astype(np.int16) - ref["pixels"].astype(np.int16))
             for o in others]
    max_diff = max((int(d.max()) for d in diffs), default=0)
    same_text = all(o["expansion_text"] == ref["expansion_text"]
                    and o["expansion_tokens"] == ref["expansion_tokens"] for o in others)
    return {"equal": same_text and max_diff <= PIXEL_TOLERANCE,
            "compared": (f"the expansion's text and length exactly; the image's pixels within "
                         f"{PIXEL_TOLERANCE} level"),
            "expansion_equal": same_text,
            "png_bytes_equal": all(o["png_sha256"] == ref["png_sha256"] for o in others),
            "pixels": int(ref["pixels"].size),
            "pixels_differing": max((int((d > 0).sum()) for d in diffs), default=0),
            "max_pixel_diff": max_diff}


def collect(params: Params, spec: Spec) -> dict[str, list[list[RoleRun]]]:
    """Both variants over the repeats (after an untimed round 0), their order reversed every
    round; each variant's time on stderr."""
    runs: dict[str, list[list[RoleRun]]] = {"omni": [], "separate": []}
    for r in range(-1 if params.warmup else 0, params.repeats):
        order = ["omni", "separate"] if r % 2 == 0 else ["separate", "omni"]
        for variant in order:
            started = time.perf_counter()
            result = run_variant(variant, spec)
            print(f"round {r + 1}/{params.repeats} image {variant}: "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            if r >= 0:
                runs[variant].append(result)
    return runs


# ---------------------------------------------------------------------------------------------
# Summary


def _samples(reps: list[list[RoleRun]], fn: Callable[[RoleRun], float]) -> Samples:
    """A variant's figure per repeat: `fn` summed over its processes, in MiB."""
    return Samples(tuple(sum(fn(p) for p in rep) / MIB for rep in reps))


def _processes(reps: list[list[RoleRun]]) -> list[dict[str, Any]]:
    """Each process of a variant over the repeats."""
    out = []
    for i, first in enumerate(reps[0]):
        runs = [rep[i] for rep in reps]

        def mib(fn: Callable[[RoleRun], float], runs: list[RoleRun] = runs) -> dict[str, Any]:
            return Samples(tuple(fn(r) / MIB for r in runs)).to_json(1)

        out.append({"role": first.role, "kv_pages": first.kv_pages, "kv_bytes": first.kv_bytes,
                    "rss_peak_mib": mib(lambda r: r.rss_peak),
                    "rss_after_imports_mib": mib(lambda r: r.rss_after_imports),
                    "ru_maxrss_mib": mib(lambda r: r.ru_maxrss),
                    "memory_end_mib": {k: round(v / MIB, 1) for k, v in first.memory_end.items()},
                    "seconds": Samples(tuple(r.seconds for r in runs)).to_json(2),
                    "figures": {k: v for k, v in first.outputs.items()
                                if k not in COMPARED_ONLY}})
    return out


def _kv_claim(k: int, kv: dict[str, Samples], equal: bool) -> dict[str, Any]:
    ratio = kv["omni"].median / kv["separate"].median if kv["separate"].median else None
    passed = equal and ratio is not None and ratio <= 1 / k + 1e-9
    out = claim(unit="MiB", target=round(1 / k, 3), measured=kv["omni"],
                baseline=kv["separate"], ratio=ratio, passed=passed, digits=3, k=k,
                note=(f"resident KV: pages in the stores at the end x page bytes (store.stats()), "
                      f"summed over the variant's processes; target: Omni's <= 1/{k} of the "
                      "separate services', with equal outputs"))
    if not passed:
        out["why"] = (f"Omni's stores hold {kv['omni'].median:.2f} MiB, the separate services' "
                      f"{kv['separate'].median:.2f} MiB" + ("" if equal else
                                                           "; the outputs differ"))
    return out


def _rss_claim(runs: dict[str, list[list[RoleRun]]], equal: bool,
               extra: dict[str, float]) -> dict[str, Any]:
    rss = {v: _samples(runs[v], lambda p: p.rss_peak) for v in runs}
    above = {v: _samples(runs[v], lambda p: p.rss_peak - p.rss_after_imports) for v in runs}
    imports = _samples(runs["omni"], lambda p: p.rss_after_imports).median
    ratio = rss["omni"].median / rss["separate"].median
    above_ratio = above["omni"].median / above["separate"].median
    out = claim(unit="MiB", target=1.0, measured=rss["omni"], baseline=rss["separate"],
                ratio=ratio, passed=equal and ratio < 1,
                above_imports={"measured": above["omni"].to_json(1),
                               "baseline": above["separate"].to_json(1),
                               "ratio": round(above_ratio, 3)},
                note=("peak RSS: VmHWM of each of the variant's processes, summed; target: "
                      "Omni's below the separate services'. above_imports: each process's "
                      "peak minus its RSS once it had imported what it runs, summed: the "
                      "weights, KV, working buffers and torch's own lazily built state, "
                      "without the interpreter and the libraries each process loads"))
    out["why"] = (f"{len(runs['separate'][0])} processes against {len(runs['omni'][0])}, each "
                  f"~{imports:.0f} MiB once it has imported torch and Omni; above that, Omni's "
                  f"process peaks at {above['omni'].median:.0f} MiB and the services' at "
                  f"{above['separate'].median:.0f} MiB together ({above_ratio:.2f}x; "
                  f"a copy of the weights is {extra['weights_mib']:.0f} MiB and of the "
                  f"prompt's KV {extra['kv_mib']:.0f} MiB, which the services hold twice)"
                  + ("" if equal else "; the outputs differ, so the claim does not hold"))
    return out


def summarise(runs: dict[str, list[list[RoleRun]]], model: dict[str, Any]) -> dict[str, Any]:
    """The image pipeline's claims, figures and output check."""
    outputs = compare_outputs([*runs["omni"], *runs["separate"]])
    equal = outputs.pop("equal")
    kv = {v: _samples(runs[v], lambda p: p.kv_bytes) for v in runs}
    extra = {"weights_mib": model["weight_bytes"] / MIB,
             "kv_mib": kv["separate"].median - kv["omni"].median}
    return {"k": K, "outputs_equal": equal, "outputs": outputs,
            "kv_bytes": _kv_claim(K, kv, equal),
            "peak_rss": _rss_claim(runs, equal, extra),
            "processes": {v: _processes(runs[v]) for v in runs}}


def measure(params: Params) -> dict[str, Any]:
    """Write the model, run every variant, return the JSON-ready result."""
    with tempfile.TemporaryDirectory(prefix="omni-footprint-model-") as folder:
        model = write_model(params, Path(folder))
        spec = make_spec(params, folder)
        runs = collect(params, spec)
    import torch

    result: dict[str, Any] = {
        "benchmark": "footprint",
        "env": {**environment(), "torch": torch.__version__, "torch_threads": params.threads},
        "params": asdict(params), "model": model,
        "requests": {"image_prompt_chars": len(spec.prompt)},
        "image": summarise(runs, model),
    }
    result["outputs_equal"] = result["image"]["outputs_equal"]
    result["all_pass"] = all(result["image"][c]["pass"] for c in ("kv_bytes", "peak_rss"))
    return result


def _plot(result: dict[str, Any], path: str) -> None:
    def bars(c: dict[str, Any]) -> dict[str, Samples]:
        return {"Omni": Samples(tuple(c["measured"]["runs"])),
                "separate": Samples(tuple(c["baseline"]["runs"]))}

    image = result["image"]
    plot_bars(path, "Footprint: roles sharing one KV copy (Omni) vs separate services", [
        (f"image: resident KV (k = {image['k']})", "MiB (lower is better)",
         bars(image["kv_bytes"])),
        ("image: peak RSS, all processes", "MiB (lower is better)", bars(image["peak_rss"]))])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write and plot) the result."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="rounds of every variant")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="write a bar chart (PNG) here")
    args = parser.parse_args(argv)
    params = Params.small(args.seed) if args.quick else Params(seed=args.seed)
    if args.repeats is not None:
        params = dataclasses.replace(params, repeats=args.repeats)
    result = measure(params)
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
