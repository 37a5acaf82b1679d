"""Qwen3-Omni on Omni vs transformers' `generate` on the same checkpoint.

A tiny random Qwen3-Omni (the tests' builder, tests/compute/omni_builders.py, at hidden 128
and 4 layers: ~3 M parameters in the thinker and as many in the talker) is saved with
`save_pretrained` and loaded by both sides: ours with `TorchEngine.from_pretrained` (the
thinker, its KV store on) and `Talker.from_pretrained`; theirs with
`Qwen3OmniMoeForConditionalGeneration.from_pretrained(dir, dtype=float32)`. Greedy thinker
and talker on both sides (the talker's repetition penalty 1.05, as transformers'), the same
number of reply tokens and codec frames.

Each round is a new conversation of `turns` turns (its first message starts with words of its
own, so nothing of an earlier round is reused); turn 1 holds an image and a 1 s clip, later
turns text. Measured per round, the two sides alternating which goes first:

- time to first audio, turn 1: ours from the request to the first audio chunk of
  `Talker.stream` over the thinker's token stream; theirs `generate(return_audio=True)`,
  which returns the audio whole at its end. Claim: ours >= 2x sooner (the ratio theirs / ours,
  median over paired rounds).
- turn k >= 2 time to first token (the thinker): ours with turn k - 1's pages in the store,
  theirs `generate(return_audio=False, thinker_max_new_tokens=1)` on the whole conversation.
  Claim: the speedup theirs / ours >= 0.8 x the ideal FLOP ratio (FLOPs to prefill the whole
  prompt / FLOPs to prefill only the tokens after the cached prefix), on the lowest turn.
- thinker decode tokens/s on turn 1's text alone (prefill taken out by difference, as
  perf/decode.py does): claim ours >= 1.0x theirs.

Each claim is made on 5 paired rounds (`--repeats` other than 5 reports, never passes).
The replies' tokens and the first turn's speech must be equal on both sides ("tokens_equal",
"audio_max_abs_diff" <= 1e-4). Torch threads: the default.

Usage: ``python perf/omni_model.py [--quick] [--out PATH.json]``
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

if __package__ in (None, ""):  # run as a script: make `perf` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni.compute import SamplingParams, TorchEngine
from omni.compute.models import DecoderConfig
from omni.compute.talker import Talker, talker_params
from perf._common import benchmark_parser, environment, params_from, write_json
from tests.compute.omni_builders import (
    hf_inputs,
    hf_model,
    hf_processor,
    save_omni_checkpoint,
)

PAIRED_RUNS = 5
TARGETS = {"first_audio": 2.0, "turn_ttft_efficiency": 0.8, "decode": 1.0}
IMAGE = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
AUDIO = (np.random.default_rng(1).standard_normal(16_000) * 0.1).astype(np.float32)
WORDS = "the quick brown fox jumps over a lazy dog what do you hear describe sound".split()


@dataclass(frozen=True)
class Params:
    """The sizes of one run (`quick` shrinks them for a smoke run)."""

    seed: int = 0
    repeats: int = PAIRED_RUNS
    hidden: int = 128
    layers: int = 4
    turns: int = 3
    reply_tokens: int = 24  # the thinker's, per turn
    codec_frames: int = 32  # the talker's codec tokens (the last makes no frame)
    decode_tokens: int = 64
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        return cls(seed=seed, repeats=1, hidden=32, layers=2, turns=2, reply_tokens=6,
                   codec_frames=8, decode_tokens=8, quick=True)


def prefill_flops(config: DecoderConfig, num_tokens: int, num_cached: int = 0) -> int:
    """Multiply-adds x 2 of prefilling tokens [num_cached, num_tokens): the active weights
    (attention projections, each token's experts or MLP) and attention over the context."""
    hidden, head_dim = config.hidden_size, int(config.head_dim or 0)
    attn = hidden * head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    experts = config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
    dense = 3 * hidden * config.intermediate_size
    per_token = sum(attn + (experts if config.is_sparse_layer(i) else dense)
                    for i in range(config.num_layers)) + hidden * config.vocab_size
    new = num_tokens - num_cached
    context = sum(range(num_cached + 1, num_tokens + 1))  # keys each new token attends to
    return 2 * (new * per_token
                + 2 * config.num_layers * config.num_heads * head_dim * context)


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def first_message(round_: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + round_)
    opening = " ".join(rng.choice(WORDS, 12))
    return user(text(opening), {"type": "image", "image": IMAGE},
                {"type": "audio", "audio": AUDIO}, text("What do you hear?"))


def their_inputs(processor: Any, messages: list[dict[str, Any]]) -> Any:
    """The processor's inputs for a conversation (turn 1's image and clip when it has them)."""
    has_media = any(p["type"] == "image" for m in messages if isinstance(m["content"], list)
                    for p in m["content"])
    return hf_inputs(processor, messages, [IMAGE] if has_media else [],
                     [AUDIO] if has_media else [])


class Sides:
    """Both sides on one checkpoint."""

    def __init__(self, directory: Path, params: Params):
        self.params = params
        self.engine = TorchEngine.from_pretrained(directory)
        self.talker = Talker.from_pretrained(directory)
        self.hf, self.processor = hf_model(directory), hf_processor(directory)
        self.thinker = SamplingParams(temperature=0, max_new_tokens=params.reply_tokens,
                                      ignore_eos=True)
        self.speech = talker_params(temperature=0, max_new_tokens=params.codec_frames,
                                    min_new_tokens=params.codec_frames)

    async def ours_first_audio(self, messages: list[dict[str, Any]]
                               ) -> tuple[float, list[int], np.ndarray]:
        started = time.perf_counter()
        prompt = self.engine.chat_prompt(messages)
        tokens: list[int] = []

        async def reply() -> Any:
            async for token in self.engine.stream(prompt, self.thinker):
                tokens.append(token)
                yield token

        first, chunks = None, []
        async for chunk in self.talker.stream(self.engine, prompt, reply(),
                                              sampling=self.speech):
            first = time.perf_counter() - started if first is None else first
            chunks.append(chunk)
        return float(first or 0.0), tokens, np.concatenate(chunks)

    def theirs_audio(self, messages: list[dict[str, Any]]) -> tuple[float, list[int], Any]:
        inputs = their_inputs(self.processor, messages)
        started = time.perf_counter()
        with torch.inference_mode():
            sequences, wav = self.hf.generate(
                **inputs, return_audio=True, thinker_do_sample=False,
                thinker_max_new_tokens=self.params.reply_tokens, thinker_eos_token_id=None,
                talker_do_sample=False, talker_max_new_tokens=self.params.codec_frames,
                talker_min_new_tokens=self.params.codec_frames)
        elapsed = time.perf_counter() - started
        return elapsed, sequences[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1)

    async def ours_ttft(self, messages: list[dict[str, Any]]) -> tuple[float, int, int, str]:
        started = time.perf_counter()
        prompt = self.engine.chat_prompt(messages)
        stream = self.engine.stream(prompt, self.thinker)
        ttft = None
        async for _ in stream:
            ttft = time.perf_counter() - started if ttft is None else ttft
        result = stream.result
        return float(ttft or 0.0), result.prompt_tokens, result.cached_tokens, result.text or ""

    def theirs_ttft(self, messages: list[dict[str, Any]]) -> float:
        inputs = their_inputs(self.processor, messages)
        started = time.perf_counter()
        with torch.inference_mode():
            self.hf.generate(**inputs, return_audio=False, thinker_do_sample=False,
                             thinker_max_new_tokens=1, thinker_eos_token_id=None)
        return time.perf_counter() - started

    async def ours_decode(self, messages: list[dict[str, Any]], new: int) -> float:
        prompt = self.engine.chat_prompt(messages)
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        started = time.perf_counter()
        await self.engine.generate(prompt, params, cache_salt=f"decode-{time.perf_counter()}")
        return time.perf_counter() - started

    def theirs_decode(self, messages: list[dict[str, Any]], new: int) -> float:
        inputs = their_inputs(self.processor, messages)
        started = time.perf_counter()
        with torch.inference_mode():
            self.hf.generate(**inputs, return_audio=False, thinker_do_sample=False,
                             thinker_max_new_tokens=new, thinker_eos_token_id=None)
        return time.perf_counter() - started


async def measure(params: Params) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = save_omni_checkpoint(Path(tmp), params.seed, params.hidden, params.layers)
        sides = Sides(directory, params)
        config = sides.engine.config
        await _warm_up(sides)
        first_audio: list[tuple[float, float]] = []
        turns: dict[int, list[dict[str, float]]] = {}
        decode: list[tuple[float, float]] = []
        equal, max_diff = True, 0.0
        for r in range(params.repeats):
            messages = [first_message(r)]
            order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
            for side in order:
                if side == "ours":
                    ours_t, ours_ids, ours_wav = await sides.ours_first_audio(messages)
                else:
                    theirs_t, theirs_ids, theirs_wav = sides.theirs_audio(messages)
            equal &= ours_ids == theirs_ids
            if ours_wav.shape[0] == theirs_wav.numel():
                max_diff = max(max_diff, float(np.abs(ours_wav - theirs_wav.numpy()).max()))
            else:
                max_diff = float("inf")
            first_audio.append((ours_t, theirs_t))
            reply_text = sides.processor.tokenizer.decode(ours_ids, skip_special_tokens=True)
            for turn in range(2, params.turns + 1):
                messages = [*messages, {"role": "assistant", "content": reply_text},
                            user(text(f"And what comes after that, turn {turn}?"))]
                times: dict[str, float] = {}
                for side in order:
                    if side == "ours":
                        ours, prompt_tokens, cached, reply_text = await sides.ours_ttft(messages)
                        times["ours"] = ours
                    else:
                        times["theirs"] = sides.theirs_ttft(messages)
                turns.setdefault(turn, []).append({
                    **times, "prompt_tokens": prompt_tokens, "cached_tokens": cached})
            text_only = [user(text(" ".join(np.random.default_rng(r).choice(WORDS, 16))))]
            decode.append(await _decode_round(sides, text_only, params.decode_tokens, order))
        parameters = {"thinker": sum(p.numel() for p in sides.hf.thinker.parameters()),
                      "talker": sum(p.numel() for p in sides.hf.talker.parameters()),
                      "code2wav": sum(p.numel() for p in sides.hf.code2wav.parameters())}
        return _summarise(params, config, first_audio, turns, decode, equal, max_diff,
                          parameters)


async def _warm_up(sides: Sides) -> None:
    """One turn each way (first calls pay for lazy initialisation)."""
    messages = [first_message(-1)]
    await sides.ours_first_audio(messages)
    sides.theirs_audio(messages)
    await sides.ours_decode([user(text("warm up"))], 2)
    sides.theirs_decode([user(text("warm up"))], 2)


async def _decode_round(sides: Sides, messages: list[dict[str, Any]], new: int,
                        order: tuple[str, str]) -> tuple[float, float]:
    """Decode tokens/s of both sides: (new - 1) / (T(new) - T(1))."""
    rates = {}
    for side in order:
        if side == "ours":
            t1 = await sides.ours_decode(messages, 1)
            tn = await sides.ours_decode(messages, new)
        else:
            t1 = sides.theirs_decode(messages, 1)
            tn = sides.theirs_decode(messages, new)
        rates[side] = (new - 1) / max(tn - t1, 1e-9)
    return rates["ours"], rates["theirs"]


def _stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    return {"median": round(statistics.median(values) * scale, 3),
            "min": round(min(values) * scale, 3), "max": round(max(values) * scale, 3)}


def _summarise(params: Params, config: DecoderConfig, first_audio: list[tuple[float, float]],
               turns: dict[int, list[dict[str, float]]], decode: list[tuple[float, float]],
               equal: bool, max_diff: float, parameters: dict[str, int]) -> dict[str, Any]:
    judged = params.repeats == PAIRED_RUNS
    audio_ratio = statistics.median(theirs / ours for ours, theirs in first_audio)
    audio_claim = {"ours_ms": _stats([o for o, _ in first_audio], 1e3),
                   "theirs_ms": _stats([t for _, t in first_audio], 1e3),
                   "ratio": round(audio_ratio, 2), "target": TARGETS["first_audio"],
                   "pass": judged and audio_ratio >= TARGETS["first_audio"]}
    turn_rows = []
    for turn, rows in sorted(turns.items()):
        speedup = statistics.median(r["theirs"] / r["ours"] for r in rows)
        prompt, cached = int(rows[0]["prompt_tokens"]), int(rows[0]["cached_tokens"])
        ideal = prefill_flops(config, prompt) / prefill_flops(config, prompt, cached)
        turn_rows.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
                          "ttft_ours_ms": _stats([r["ours"] for r in rows], 1e3),
                          "ttft_theirs_ms": _stats([r["theirs"] for r in rows], 1e3),
                          "speedup": round(speedup, 2), "ideal_flop_ratio": round(ideal, 2),
                          "efficiency": round(speedup / ideal, 2)})
    lowest = min(t["efficiency"] for t in turn_rows) if turn_rows else 0.0
    decode_ratio = statistics.median(o / t for o, t in decode)
    claims_pass = {
        "first_audio": audio_claim["pass"],
        "turn_ttft": judged and lowest >= TARGETS["turn_ttft_efficiency"],
        "decode": judged and decode_ratio >= TARGETS["decode"],
        "equal": equal and max_diff <= 1e-4}
    why = [] if judged else [f"{params.repeats} paired rounds where the claims are made on "
                             f"{PAIRED_RUNS}: the figures are reported, the claims not judged"]
    return {
        "benchmark": "omni_model", "params": asdict(params), "environment": environment(),
        "parameters": parameters,
        "env": {"transformers": _transformers_version()},
        "tokens_equal": equal, "audio_max_abs_diff": max_diff,
        "first_audio": audio_claim,
        "turns": turn_rows,
        "turn_ttft": {"lowest_efficiency": lowest, "target": TARGETS["turn_ttft_efficiency"],
                      "pass": claims_pass["turn_ttft"]},
        "decode": {"ours_tokens_per_s": _stats([o for o, _ in decode]),
                   "theirs_tokens_per_s": _stats([t for _, t in decode]),
                   "ratio": round(decode_ratio, 2), "target": TARGETS["decode"],
                   "pass": claims_pass["decode"]},
        "claim": {"paired_runs": params.repeats, "all_pass": all(claims_pass.values()),
                  "why": "; ".join(why + [k for k, v in claims_pass.items() if not v])},
    }


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write) the result."""
    parser = benchmark_parser(__doc__, repeats_help="paired rounds (the claims: 5)",
                              plot_help="unused", profile_help="unused")
    args = parser.parse_args(argv)
    params = params_from(args, Params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trio.run(measure, params)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
