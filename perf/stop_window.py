"""The cost of one decode step's stop check: SGLang's tail window against the whole output.

`TorchEngine` looks for stop strings and regexes in the text of the output's last
``max(stop_str_max_len, stop_regex_max_len) + 1`` tokens (`RequestSamplingState.stop_tail_ids`),
as SGLang does. The baseline is the rule it replaces: decode the whole output every step and
search it. One step's check = decode (special tokens kept) + `check_stop`; the request has
``stop=["\\n\\n", "</answer>"]`` and ``stop_regex=["[0-9]{3}"]`` and an output of L random
lowercase letters (no match, so every step pays the full check), for L in `lengths`.

Tokenizers: "byte" (`ByteTokenizer`) and "bpe" (a byte-level BPE of 1,000 tokens trained by the
`tokenizers` library on generated text, read through `HFTokenizer`, as a checkpoint's is).

Claim: at the longest output (16,384 tokens) the whole-output check costs at least 50x the tail
window's (ratio = whole / window, target >= 50), which a window that grew with L would break.
How flat the window's cost is (its cost at the longest L over the shortest) is reported beside
it as `flatness`.

Usage: ``python perf/stop_window.py [--quick] [--seed N] [--repeats N] [--out PATH.json]``
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.compute.sampling import RequestSamplingState, SamplingParams
from omni.compute.tokenizer import ByteTokenizer, HFTokenizer
from perf._common import (
    alternate,
    claim,
    environment,
    params_from,
    plot_bars,
    time_call,
    write_json,
)

__all__ = ["Params", "main", "measure"]

TARGET = 50.0  # whole-output check / tail window's, at the longest output, at least
STOPS = SamplingParams(max_new_tokens=None, stop=["\n\n", "</answer>"], stop_regex=["[0-9]{3}"])


@dataclass(frozen=True, slots=True)
class Params:
    """The sizes of one run (`small` for a smoke run)."""

    seed: int = 0
    repeats: int = 5
    steps: int = 200  # checks timed per sample
    lengths: tuple[int, ...] = (256, 2048, 16384)

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run (a second or two)."""
        return cls(seed=seed, repeats=1, steps=20, lengths=(64, 512))


def bpe_tokenizer(folder: Path, seed: int) -> HFTokenizer:
    """A byte-level BPE of 1,000 tokens trained on seeded random words, as tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(400)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(2000)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=1000, min_frequency=2, show_progress=False)
    path = folder / "tokenizer.json"
    bpe.save(str(path))
    return HFTokenizer(path, eos_token_ids=())


def output_of(tokenizer: Any, length: int, seed: int) -> list[int]:
    """`length` token ids of random lowercase text (no stop string or regex in it)."""
    rng, ids = random.Random(seed), []
    while len(ids) < length:
        ids += tokenizer.encode("".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=256)))
    return ids[:length]


def step_cost(tokenizer: Any, output: list[int], steps: int, *, tail: bool) -> Callable[[], float]:
    """A measure: seconds per stop check after `output`, window or whole output."""
    request = RequestSamplingState(STOPS, encode=tokenizer.encode)
    request.output_token_ids.extend(output)

    def check() -> None:
        for _ in range(steps):
            ids = request.stop_tail_ids() if tail else request.output_token_ids
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert request.check_stop(output[-1], text) is None

    return lambda: time_call(check) / steps


def measure(params: Params, tokenizers: dict[str, Any]) -> dict[str, Any]:
    """Per tokenizer and output length, microseconds per check (window, whole output)."""
    result: dict[str, Any] = {}
    for name, tokenizer in tokenizers.items():
        cases = []
        for length in params.lengths:
            output = output_of(tokenizer, length, params.seed)
            costs = alternate({"window": step_cost(tokenizer, output, params.steps, tail=True),
                               "whole": step_cost(tokenizer, output, params.steps, tail=False)},
                              params.repeats)
            cases.append({"length": length, **{k: v.map(lambda s: s * 1e6)
                                               for k, v in costs.items()}})
        result[name] = cases
    return result


def claims(measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One claim per tokenizer: at the longest output, the whole-output check costs at
    least `TARGET` times the window's."""
    out = []
    for name, cases in measured.items():
        first, last = cases[0], cases[-1]
        ratio = last["whole"].median / last["window"].median
        out.append({"tokenizer": name, **claim(
            unit="us per check", target=TARGET, measured=last["window"],
            baseline=last["whole"], ratio=ratio, passed=ratio >= TARGET, digits=2,
            window_at_shortest=first["window"].to_json(2),
            flatness=round(last["window"].median / first["window"].median, 3),
            cases=[{"length": c["length"], "window": c["window"].to_json(2),
                    "whole": c["whole"].to_json(2)} for c in cases],
            note=(f"ratio: the whole output decoded and searched at {last['length']} tokens / "
                  f"the tail window at {last['length']}; flatness: the window at "
                  f"{last['length']} / at {first['length']}"))})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run, print the JSON (and write it with --out); `all_pass` says whether
    every claim met its target."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="samples per case")
    parser.add_argument("--out", help="also write the JSON here (folders are created)")
    parser.add_argument("--plot", help="PNG: µs per check at the longest output, window vs "
                                       "whole output, per tokenizer")
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    with tempfile.TemporaryDirectory() as folder:
        tokenizers = {"byte": ByteTokenizer(), "bpe": bpe_tokenizer(Path(folder), params.seed)}
        measured = measure(params, tokenizers)
        results = claims(measured)
    if args.plot:
        longest = params.lengths[-1]
        plot_bars(args.plot, f"one stop check at {longest:,} output tokens", [
            (f"{name} tokenizer", "µs per check",
             {"tail window": cases[-1]["window"], "whole output": cases[-1]["whole"]})
            for name, cases in measured.items()])
    report = {"benchmark": "stop_window", "environment": environment(),
              "params": {"lengths": list(params.lengths), "steps": params.steps,
                         "repeats": params.repeats},
              "claims": results, "all_pass": all(c["pass"] for c in results)}
    write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
