"""SGLang 0.5.23's sampling decisions, one fact per row, with the source each comes from.

`PARAM_ROWS`: a request's sampling parameters and whether SGLang's
``SamplingParams(**params)`` -> ``normalize()`` -> ``verify(VOCAB_SIZE)`` accepts
them (``sglang``), Omni's decision where Omni is stricter (``omni``, listed in the
`SamplingParams` docstring), and normalised values both must show (``values``; a top_k of -1
is SGLang's TOP_K_ALL).

`STOP_ROWS`: when a request ends (``reason``, ``matched``) after its last output token.

`SAMPLING_ROWS`: logits (or probabilities, whose float32 logs are the logits), the request's
params, prompt, output so far and EOS ids, and SGLang's result: ``scores``, the logits after
penalties / min_new_tokens / logit_bias, and ``kept``, the token ids that top-k / top-p /
min-p keep (greedy: the argmax). The distribution is then softmax(scores / temperature)
restricted to ``kept`` and renormalised.

tests/compute/test_sglang_conformance.py runs every row against Omni; `sglang_oracle.py`
(``python -m tests.compute.sglang_oracle`` where sglang imports) runs every row against
SGLang's own code.
"""

from __future__ import annotations

import math
from typing import Any

import torch

VOCAB_SIZE = 16
SP = "sglang/srt/sampling/sampling_params.py"
NORMALIZE, VERIFY, POST_INIT = (f"{SP}:SamplingParams.normalize", f"{SP}:SamplingParams.verify",
                                f"{SP}:SamplingParams.__post_init__")
TORCH_SAMPLER = "sglang/srt/layers/sampler.py:top_k_top_p_min_p_sampling_from_probs_torch"
GREEDY = "sglang/srt/layers/sampler.py:Sampler.forward (is_all_greedy: argmax)"
PENALTIES = "sglang/srt/sampling/sampling_batch_info.py:SamplingBatchInfo.update_penalties"
REPETITION = "sglang/srt/sampling/penaltylib/repetition_penalty.py:apply_scaling_penalties"
FREQUENCY = "sglang/srt/sampling/penaltylib/frequency_penalty.py:BatchedFrequencyPenalizer"
PRESENCE = "sglang/srt/sampling/penaltylib/presence_penalty.py:BatchedPresencePenalizer"
MIN_NEW = "sglang/srt/sampling/penaltylib/min_new_tokens.py:BatchedMinNewTokensPenalizer"
BIAS = "sglang/srt/sampling/sampling_batch_info.py:SamplingBatchInfo.apply_logits_bias"


def _param(params: dict[str, Any], sglang: bool, source: str, *, omni: bool | None = None,
           values: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"params": params, "sglang": sglang, "omni": sglang if omni is None else omni,
            "values": values or {}, "source": source}


_STOPS = [f"s{i}" for i in range(33)]
_NAN, _INF = math.nan, math.inf

PARAM_ROWS: list[dict[str, Any]] = [
    _param({}, True, POST_INIT, values={"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0,
                                        "top_k": -1, "min_p": 0.0, "n": 1, "min_new_tokens": 0}),
    # max_new_tokens / min_new_tokens
    _param({"max_new_tokens": -1}, False, VERIFY),
    _param({"max_new_tokens": 0}, True, VERIFY),
    _param({"max_new_tokens": None}, True, VERIFY, values={"max_new_tokens": None}),
    _param({"max_new_tokens": 1.5}, True, VERIFY, omni=False),
    _param({"min_new_tokens": -1}, False, VERIFY),
    _param({"min_new_tokens": 128}, True, VERIFY),
    _param({"min_new_tokens": 129}, False, VERIFY),
    _param({"min_new_tokens": 5, "max_new_tokens": 4}, False, VERIFY),
    _param({"min_new_tokens": 10_000, "max_new_tokens": None}, True, VERIFY),
    _param({"min_new_tokens": None}, True, POST_INIT, values={"min_new_tokens": 0}),
    # temperature
    _param({"temperature": -0.1}, False, VERIFY),
    _param({"temperature": 0.0}, True, POST_INIT, values={"top_k": 1}),
    _param({"temperature": 1e-7, "top_k": 50}, True, POST_INIT, values={"top_k": 1}),
    _param({"temperature": 0.0, "top_k": 0}, True, POST_INIT, values={"top_k": 1}),
    _param({"temperature": 1e-6, "top_k": 50}, True, POST_INIT, values={"top_k": 50}),
    _param({"temperature": _NAN}, False, VERIFY),
    _param({"temperature": _INF}, False, VERIFY),
    _param({"temperature": None}, True, POST_INIT, values={"temperature": 1.0}),
    _param({"temperature": True}, True, VERIFY, omni=False),
    _param({"temperature": "1"}, False, POST_INIT),
    _param({"top_k": "5"}, False, VERIFY),
    # top_p
    _param({"top_p": 0.0}, False, VERIFY),
    _param({"top_p": 1e-9}, True, VERIFY),
    _param({"top_p": 1.0}, True, VERIFY),
    _param({"top_p": 1.0000001}, False, VERIFY),
    _param({"top_p": _NAN}, False, VERIFY),
    _param({"top_p": None}, True, POST_INIT, values={"top_p": 1.0}),
    # top_k
    _param({"top_k": 0}, False, VERIFY),
    _param({"top_k": -1}, True, POST_INIT, values={"top_k": -1}),
    _param({"top_k": -2}, False, VERIFY),
    _param({"top_k": 1}, True, VERIFY, values={"top_k": 1}),
    _param({"top_k": 1 << 30}, True, VERIFY, values={"top_k": -1}),  # TOP_K_ALL: off
    _param({"top_k": (1 << 30) + 1}, True, VERIFY, values={"top_k": (1 << 30) + 1}),
    _param({"top_k": None}, True, POST_INIT, values={"top_k": -1}),
    _param({"top_k": 2.0}, True, VERIFY, omni=False),
    # min_p
    _param({"min_p": -0.01}, False, VERIFY),
    _param({"min_p": 0.0}, True, VERIFY),
    _param({"min_p": 1.0}, True, VERIFY),
    _param({"min_p": 1.01}, False, VERIFY),
    _param({"min_p": None}, True, POST_INIT, values={"min_p": 0.0}),
    # penalties
    *[_param({name: value}, ok, VERIFY) for name in ("frequency_penalty", "presence_penalty")
      for value, ok in ((-2.0, True), (2.0, True), (-2.01, False), (2.01, False), (_NAN, False))],
    _param({"frequency_penalty": None}, True, POST_INIT, values={"frequency_penalty": 0.0}),
    _param({"presence_penalty": None}, True, POST_INIT, values={"presence_penalty": 0.0}),
    _param({"repetition_penalty": 0.0}, False, VERIFY),
    _param({"repetition_penalty": 0.01}, True, VERIFY),
    _param({"repetition_penalty": 2.0}, True, VERIFY),
    _param({"repetition_penalty": 2.01}, False, VERIFY),
    _param({"repetition_penalty": None}, True, POST_INIT, values={"repetition_penalty": 1.0}),
    # n
    _param({"n": 4}, True, POST_INIT, values={"n": 4}),
    _param({"n": None}, True, POST_INIT, values={"n": 1}),
    _param({"n": 0}, True, POST_INIT, omni=False),
    # sampling_seed
    _param({"sampling_seed": 2**63 - 1}, True, VERIFY),
    _param({"sampling_seed": -(2**63)}, True, VERIFY),
    _param({"sampling_seed": 2**63}, False, VERIFY),
    _param({"sampling_seed": -(2**63) - 1}, False, VERIFY),
    _param({"sampling_seed": "1"}, False, VERIFY),
    _param({"sampling_seed": True}, True, VERIFY, omni=False),
    _param({"seed": 1}, False, "SamplingParams has no field 'seed' (TypeError)"),
    # stop strings and token ids
    _param({"stop": "x"}, True, NORMALIZE),
    _param({"stop": _STOPS[:32]}, True, NORMALIZE),
    _param({"stop": _STOPS[:33]}, False, NORMALIZE),
    _param({"stop": ["a"] * 33}, False, NORMALIZE),
    _param({"stop": []}, True, NORMALIZE),
    _param({"stop": [""]}, True, NORMALIZE, omni=False),
    _param({"stop_token_ids": [1, 2]}, True, POST_INIT),
    _param({"stop_token_ids": [-1]}, True, POST_INIT),
    _param({"stop_token_ids": [None, 3]}, True, POST_INIT),
    _param({"stop_token_ids": ["3"]}, True, POST_INIT, omni=False),
    # stop_regex
    _param({"stop_regex": "a+b"}, True, NORMALIZE),
    _param({"stop_regex": _STOPS[:32]}, True, NORMALIZE),
    _param({"stop_regex": _STOPS[:33]}, False, NORMALIZE),
    _param({"stop_regex": "a" * 256}, True, NORMALIZE),
    _param({"stop_regex": "a" * 257}, False, NORMALIZE),
    _param({"stop_regex": "\u00e9" * 128}, True, NORMALIZE),  # 256 UTF-8 bytes
    _param({"stop_regex": "\u00e9" * 129}, False, NORMALIZE),
    _param({"stop_regex": "("}, False, f"{SP}:get_max_seq_length (re.error)"),
    # logit_bias
    _param({"logit_bias": {"0": 1.0, str(VOCAB_SIZE - 1): -1.0}}, True, VERIFY),
    _param({"logit_bias": {str(VOCAB_SIZE): 1.0}}, False, VERIFY),
    _param({"logit_bias": {"-1": 1.0}}, False, VERIFY),
    _param({"logit_bias": {"a": 1.0}}, False, VERIFY),
    _param({"logit_bias": {" 5": 1.0}}, True, VERIFY),
    _param({"logit_bias": {"5": -_INF}}, True, VERIFY),
    _param({"logit_bias": {"5": _NAN}}, True, VERIFY, omni=False),
    _param({"logit_bias": {5: 1.0}}, True, VERIFY),
    _param({"logit_bias": {5.0: 1.0}}, True, VERIFY, omni=False),
    # grammars
    _param({"json_schema": "{}", "regex": "a"}, False, VERIFY),
    _param({"regex": "a", "ebnf": "root ::= 'a'"}, False, VERIFY),
    _param({"json_schema": "", "regex": "a+"}, True, POST_INIT, values={"json_schema": None}),
    _param({"structural_tag": "{}"}, True, VERIFY),
    _param({"json_schema": {"type": "object"}}, True, VERIFY, omni=False),
    # flags, stream_interval, custom_params
    _param({"skip_special_tokens": None, "no_stop_trim": None}, True, POST_INIT,
           values={"skip_special_tokens": True, "no_stop_trim": False}),
    _param({"ignore_eos": None, "spaces_between_special_tokens": False}, True, POST_INIT,
           values={"ignore_eos": False, "spaces_between_special_tokens": False}),
    _param({"stream_interval": 1}, True, VERIFY),
    _param({"stream_interval": 0}, True, VERIFY, omni=False),
    _param({"custom_params": {"budget": 3, "ids": [1, 2], "m": {"a": None}}}, True, VERIFY),
    _param({"custom_params": {"__sglang_reasoning_end_token_ids": [5]}}, True, VERIFY),
    _param({"custom_params": "x"}, True, VERIFY, omni=False),
    _param({"custom_params": {"__sglang_reasoning_end_token_ids": []}}, False, VERIFY),
    _param({"custom_params": {"__sglang_reasoning_end_token_ids": [VOCAB_SIZE]}}, False,
           VERIFY),
    _param({"beam_width": 2}, True, VERIFY, omni=False),
]


def _sample(source: str, *, kept: list[int], logits: list[float] | None = None,
            probs: list[float] | None = None, scores: list[float] | None = None,
            prompt: tuple[int, ...] = (), output: tuple[int, ...] = (),
            eos: tuple[int, ...] = (), **params: Any) -> dict[str, Any]:
    row_logits = logits if logits is not None else [math.log(p) for p in probs or ()]
    return {"logits": logits, "probs": probs, "params": params, "prompt": list(prompt),
            "output": list(output), "eos": list(eos), "kept": kept,
            "scores": scores if scores is not None else row_logits, "source": source}


SAMPLING_ROWS: list[dict[str, Any]] = [
    # top-k keeps exactly k, ties broken towards the lower token id
    _sample(TORCH_SAMPLER, logits=[3, 2, 2, 2, 1, 0], top_k=2, kept=[0, 1]),
    _sample(TORCH_SAMPLER, logits=[2, 3, 2, 3, 2, 1], top_k=3, kept=[1, 3, 0]),
    _sample(TORCH_SAMPLER, probs=[0.4, 0.2, 0.2, 0.2], top_k=3, kept=[0, 1, 2]),
    # top-p keeps a token while the mass before it is <= top_p
    _sample(TORCH_SAMPLER, probs=[0.4, 0.2, 0.2, 0.2], top_p=0.5, kept=[0, 1]),
    _sample(TORCH_SAMPLER, probs=[0.5, 0.25, 0.25], top_p=0.5, kept=[0, 1]),
    _sample(TORCH_SAMPLER, probs=[0.5, 0.25, 0.25], top_p=0.49, kept=[0]),
    _sample(TORCH_SAMPLER, probs=[0.25, 0.5, 0.25], top_p=0.75, kept=[1, 0, 2]),
    _sample(TORCH_SAMPLER, probs=[0.1, 0.2, 0.3, 0.4], top_p=1e-9, kept=[3]),
    # min-p is relative to the most likely token; a token exactly at the floor stays
    _sample(TORCH_SAMPLER, probs=[0.5, 0.25, 0.25], min_p=0.5, kept=[0, 1, 2]),
    _sample(TORCH_SAMPLER, probs=[0.5, 0.25, 0.25], min_p=0.51, kept=[0]),
    _sample(TORCH_SAMPLER, probs=[0.1, 0.2, 0.3, 0.4], min_p=1.0, kept=[3]),
    # the filters intersect on one distribution
    _sample(TORCH_SAMPLER, probs=[0.4, 0.3, 0.2, 0.1], top_k=3, top_p=0.5, kept=[0, 1]),
    _sample(TORCH_SAMPLER, probs=[0.4, 0.3, 0.2, 0.1], top_k=3, min_p=0.6, kept=[0, 1]),
    _sample(TORCH_SAMPLER, logits=[1.0, 0.5, 0.0, -1.0], temperature=0.5, top_p=0.8,
            kept=[0, 1]),
    # greedy: the argmax, the lower token id on a tie
    _sample(GREEDY, logits=[1, 3, 3, 0], temperature=0.0, kept=[1]),
    _sample(GREEDY, logits=[1, 3, 3, 0], top_k=1, kept=[1]),
    # penalties count output tokens only
    _sample(REPETITION, logits=[2, 1, 0], prompt=(0,), repetition_penalty=2.0, kept=[0, 1, 2]),
    _sample(REPETITION, logits=[2, 1, 0], output=(0,), repetition_penalty=2.0,
            scores=[1, 1, 0], kept=[0, 1, 2]),
    _sample(REPETITION, logits=[-1, 0.5, 0], output=(0, 1), repetition_penalty=2.0,
            scores=[-2, 0.25, 0], kept=[0, 1, 2]),
    _sample(FREQUENCY, logits=[2, 1, 0], prompt=(2,), output=(0, 0, 1), frequency_penalty=0.5,
            scores=[1, 0.5, 0], kept=[0, 1, 2]),
    _sample(PRESENCE, logits=[2, 1, 0], prompt=(2,), output=(0, 0, 1), presence_penalty=0.5,
            scores=[1.5, 0.5, 0], kept=[0, 1, 2]),
    _sample(PENALTIES, logits=[1, -1, 0], output=(0, 1), frequency_penalty=0.5,
            repetition_penalty=2.0, scores=[0.25, -3, 0], kept=[0, 1, 2]),
    _sample(PENALTIES, logits=[2, 1, 0], output=(0,), presence_penalty=-1.0,
            temperature=0.0, scores=[3, 1, 0], kept=[0]),
    # logit_bias is added after the penalties
    _sample(BIAS, logits=[2, 1, 0], logit_bias={"2": 5.0}, scores=[2, 1, 5], kept=[0, 1, 2]),
    _sample(BIAS, logits=[2, 1, 0], logit_bias={"0": -_INF}, scores=[-_INF, 1, 0],
            kept=[1, 2]),
    _sample(BIAS, logits=[2, 1, 0], output=(0,), logit_bias={"0": 1.0},
            repetition_penalty=2.0, scores=[2, 1, 0], kept=[0, 1, 2]),
    # min_new_tokens masks EOS and stop_token_ids until reached (even with ignore_eos)
    _sample(MIN_NEW, logits=[2, 1, 0, 0], eos=(0,), stop_token_ids=[1], min_new_tokens=2,
            output=(3,), scores=[-_INF, -_INF, 0, 0], kept=[2, 3]),
    _sample(MIN_NEW, logits=[2, 1, 0, 0], eos=(0,), stop_token_ids=[1], min_new_tokens=2,
            output=(3, 3), kept=[0, 1, 2, 3]),
    _sample(MIN_NEW, logits=[2, 1, 0, 0], eos=(0,), min_new_tokens=1, ignore_eos=True,
            temperature=0.0, scores=[-_INF, 1, 0, 0], kept=[1]),
]


FINISH = "sglang/srt/managers/schedule_batch.py:Req.update_finish_state"


def _stop(output: bytes | list[int], reason: str | None, matched: int | str | None = None, *,
          eos: tuple[int, ...] = (), terminated: bool = False, **params: Any) -> dict[str, Any]:
    return {"params": params, "output": list(output), "eos": list(eos),
            "terminated": terminated, "reason": reason, "matched": matched, "source": FINISH}


# `output` is token ids that are bytes (the text is their UTF-8 decoding); one check after the
# last token, as SGLang runs it after each decode step. In SGLang's order: stop strings (list
# order), stop regexes, stop/EOS ids (ignore_eos ignores both), length, a terminated grammar.
STOP_ROWS: list[dict[str, Any]] = [
    _stop(b"ab\nEND", "stop", "END", stop=["END", "\n"]),
    _stop(b"ab12", "stop", "[0-9]{2}", stop_regex=["[0-9]{2}"]),
    _stop(b"ab12", "stop", "b1", stop=["b1"], stop_regex=["[0-9]{2}"]),
    _stop(b"ax\x02", "stop", "x", eos=(2,), stop=["x"]),
    _stop(b"ab\x02", "stop", 2, eos=(2,), max_new_tokens=3),
    _stop(b"abc", "length", None, eos=(2,), max_new_tokens=3),
    _stop(b"ab", None, None, eos=(2,), max_new_tokens=3),
    _stop(b"a\x02", None, None, eos=(2,), ignore_eos=True),
    _stop(b"a\x05", None, None, stop_token_ids=[5], ignore_eos=True),
    _stop(b"a\x05", "stop", 5, stop_token_ids=[5]),
    _stop(b"ax", "stop", "x", stop=["x"], ignore_eos=True),
    _stop(b"a", "stop", 97, terminated=True),
    _stop(b"a", "length", None, terminated=True, max_new_tokens=1),
    _stop(b"a\x02", "stop", 2, eos=(2,), terminated=True),
]


def row_logits(row: dict[str, Any]) -> torch.Tensor:
    """The row's logits as float32 [V] (the float32 logs of its probabilities)."""
    if row["logits"] is not None:
        return torch.tensor(row["logits"], dtype=torch.float32)
    return torch.tensor(row["probs"], dtype=torch.float32).log()


def expected_distribution(row: dict[str, Any], temperature: float) -> torch.Tensor:
    """softmax(scores / temperature) restricted to `kept`, renormalised (one-hot if greedy)."""
    scores = torch.tensor(row["scores"], dtype=torch.float32)
    if temperature < 1e-6:
        return torch.nn.functional.one_hot(torch.tensor(row["kept"][0]), len(scores)).float()
    probs = torch.softmax(scores / temperature, dim=-1)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[row["kept"]] = True
    kept = torch.where(mask, probs, 0.0)
    return kept / kept.sum()
