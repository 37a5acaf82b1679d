"""Float32 linears on the CPU: MKL with packed weights, oneDNN and plain MKL sgemm
(`omni.compute.models._linear`), and whether the backend Omni picks for this CPU is the
fastest.

The model is perf/prefix_reuse.py's (a random Llama of hidden 512, 8 layers, MLP 1536; with
--quick, its smoke model of hidden 128 and 2 layers). The three backends run the same code in
the same run, alternated round by round, each set with `set_cpu_linear_backend`: "mkl_packed"
(each weight packed once into MKL's layout), "onednn" and "mkl" (plain `F.linear`, one sgemm
per call, torch's own path). Omni's choice is oneDNN on AMD CPUs and MKL with packed weights
elsewhere (`default_cpu_linear_backend`).

- "layer": the four linears of one layer (q/k/v, o, gate/up, down) at 1, 4, 16, 208 and
  1,936 rows (decode batches, a chat turn's new tokens, a whole 2k-token prompt);
- "model": a whole forward and its last row of logits: a 208-token prefill over 1,728 cached
  tokens (a chat's last turn), a 1,936-token prefill (the same turn recomputed), and one
  decode step over 1,936 tokens.

Claim: in every case, the time of the fastest other backend whose kernels differ here / the
chosen one's >= 1.0: Omni's choice is never the slower. "mkl_packed" runs plain sgemm at 1
row and above 1,024 rows (`packed_rows`), the same kernels as "mkl": where a case has no call in
between, the two are the same path and only the third is compared ("same_kernels_as").
Outputs must equal plain MKL's to float32 rounding ("max_abs_diff"); each case also records
every backend's speed relative to plain MKL's ("vs_mkl").

Usage: ``python perf/cpu_linear.py [--quick] [--seed N] [--repeats N] [--out PATH.json]
[--plot PATH.png]``
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.compute.models import (
    DecoderLM,
    cpu_linear_backend,
    set_cpu_linear_backend,
    tiny_model,
)
from omni.compute.models._linear import cpuinfo_field, packed_rows
from perf._common import (
    Samples,
    alternate,
    benchmark_parser,
    claim,
    environment,
    params_from,
    plot_bars,
    time_call,
    write_json,
)
from perf.prefix_reuse import Params as PrefixReuseParams

__all__ = ["Params", "main", "measure"]

TARGET = 1.0  # the fastest other distinct backend's time / the chosen one's, at least
BACKENDS = ("mkl_packed", "onednn", "mkl")
NAMES = {"mkl_packed": "MKL, packed weights", "onednn": "oneDNN", "mkl": "MKL"}


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`small` for a smoke run)."""

    seed: int = 0
    repeats: int = 15
    layer_rows: tuple[int, ...] = (1, 4, 16, 208, 1936)
    cached_tokens: int = 1728
    new_tokens: int = 208
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a few seconds), on prefix_reuse's smoke model."""
        return cls(seed=seed, repeats=2, layer_rows=(1, 208), cached_tokens=96, new_tokens=40,
                   quick=True)


@contextmanager
def _backend(name: str) -> Iterator[None]:
    """`name`'s path for the block, this CPU's default restored after."""
    set_cpu_linear_backend(name)
    try:
        yield
    finally:
        set_cpu_linear_backend(None)


def _timed(fn: Callable[[], Any], backend: str) -> Callable[[], float]:
    """One call of `fn` with `backend`, in seconds."""

    def run() -> float:
        with _backend(backend):
            return time_call(fn)
    return run


def _output(fn: Callable[[], torch.Tensor], backend: str) -> torch.Tensor:
    with _backend(backend):
        return fn()


def _case(name: str, fn: Callable[[], torch.Tensor], repeats: int, rows: int,
          **figures: Any) -> dict[str, Any]:
    """Every backend on `fn` (whose linears see `rows` rows, the logits' one aside), paired
    rounds; the claim's ratio is the median pair of the fastest other distinct backend's
    time over the chosen one's."""
    reference = _output(fn, "mkl")
    diff = max((_output(fn, backend) - reference).abs().max().item()
               for backend in BACKENDS)
    times = alternate({backend: _timed(fn, backend) for backend in BACKENDS}, repeats)
    ms = {side: samples.map(lambda s: s * 1e3) for side, samples in times.items()}
    chosen = cpu_linear_backend()  # the default, restored after each call above
    same = {"mkl_packed": "mkl", "mkl": "mkl_packed"}
    same_kernels = [] if packed_rows(rows) or chosen not in same else [same[chosen]]
    others = [b for b in BACKENDS if b != chosen and b not in same_kernels]

    def paired(num: str, den: str) -> float:
        return Samples(tuple(b / a for a, b in zip(ms[den].values, ms[num].values,
                                                   strict=True))).median
    ratios = {other: paired(other, chosen) for other in others}
    baseline = min(ratios, key=ratios.__getitem__)
    ratio = ratios[baseline]
    return {"case": name, "rows": rows, **figures, "backend": chosen,
            "baseline_backend": baseline,
            "same_kernels_as": same_kernels, **claim(
        unit="ms per call", target=TARGET, measured=ms[chosen], baseline=ms[baseline],
        ratio=ratio, passed=ratio >= TARGET, digits=3, max_abs_diff=diff,
        vs_mkl={b: round(paired("mkl", b), 3) for b in BACKENDS},
        times_ms={b: ms[b].to_json(3) for b in BACKENDS},
        note=(f"measured: {chosen} (Omni's choice on this CPU), baseline: {baseline} (the "
              "fastest other backend with other kernels here); ratio = median over rounds "
              "of the baseline's time / the measured one's (paired, alternated); vs_mkl: "
              "plain MKL's time / each backend's, the same way"))}


def layer_cases(model: DecoderLM, params: Params) -> list[dict[str, Any]]:
    """The four linears of layer 0 at each row count."""
    layer = model.layers[0]
    linears = [layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj]
    cases = []
    for rows in params.layer_rows:
        inputs = [torch.randn(rows, module.in_features) for module in linears]

        def four(inputs: list[torch.Tensor] = inputs) -> torch.Tensor:
            return torch.cat([module(x).flatten() for x, module in zip(inputs, linears,
                                                                        strict=True)])
        cases.append(_case(f"layer, {rows} rows", four, params.repeats, rows=rows,
                           shapes=[list(module.weight.shape) for module in linears]))
    return cases


def model_cases(model: DecoderLM, params: Params) -> list[dict[str, Any]]:
    """Whole forwards: a reusing prefill, the same prompt recomputed, a decode step."""
    config = model.config
    kv_heads, head_dim = config.num_kv_heads, int(config.head_dim or 0)
    total = params.cached_tokens + params.new_tokens

    def forward(new: int, cached: int) -> Callable[[], torch.Tensor]:
        hidden = model.embed(torch.randint(3, config.vocab_size, (1, new)))
        positions = torch.arange(cached, cached + new)[None]
        past = [(torch.randn(1, kv_heads, cached, head_dim),
                 torch.randn(1, kv_heads, cached, head_dim))
                for _ in range(config.num_layers)] if cached else None
        return lambda: model.logits(model(hidden, positions, past)[0][:, -1])

    return [
        _case(f"prefill {params.new_tokens} over {params.cached_tokens} cached",
              forward(params.new_tokens, params.cached_tokens), params.repeats,
              params.new_tokens, new_tokens=params.new_tokens,
              cached_tokens=params.cached_tokens),
        _case(f"prefill {total}", forward(total, 0), max(3, params.repeats // 3), total,
              new_tokens=total, cached_tokens=0),
        _case(f"decode step over {total}", forward(1, total), params.repeats * 4, 1,
              new_tokens=1, cached_tokens=total),
    ]


@torch.inference_mode()
def measure(params: Params) -> dict[str, Any]:
    """Both sets of cases; the result dict."""
    torch.manual_seed(params.seed)
    model_params = PrefixReuseParams.small() if params.quick else PrefixReuseParams()
    overrides = model_params.model_overrides()
    model, config = tiny_model(seed=params.seed, **overrides)
    layers, whole = layer_cases(model, params), model_cases(model, params)
    cases = layers + whole
    return {
        "benchmark": "cpu_linear",
        "env": {**environment(), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "cpu": cpuinfo_field("model name") or "unknown"},
        "backend": cpu_linear_backend(),
        "params": asdict(params),
        "model": {"architecture": config.architecture, **overrides,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "layer": layers,
        "model_cases": whole,
        "target": TARGET,
        "pass": all(c["pass"] for c in cases),
        "max_abs_diff": max(c["max_abs_diff"] for c in cases),
    }


def _plot(result: dict[str, Any], path: str) -> None:
    """One panel per whole-model case: every backend's ms per call."""
    chosen = result["backend"]
    plot_bars(path, f"float32 linears on {result['env']['cpu']}, "
                    f"{result['env']['torch_threads']} threads", [
        (case["case"], "ms per call (lower is better)",
         {NAMES[b] + ("\n(Omni's choice)" if b == chosen else ""):
          Samples(tuple(case["times_ms"][b]["runs"])) for b in BACKENDS})
        for case in result["model_cases"]])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write) the result."""
    parser = benchmark_parser(__doc__, repeats_help="paired rounds per case",
                              plot_help="write a chart (PNG) of the whole-model cases here",
                              profile_help="(no profile: torch.profiler shows the ops)")
    args = parser.parse_args(argv)
    result = measure(params_from(args, Params))
    write_json(result, args.out)
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
