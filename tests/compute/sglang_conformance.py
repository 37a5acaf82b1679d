"""SGLang 0.5.23's sampling decisions, one fact per row, with the source each comes from.

`PARAM_ROWS`: a request's sampling parameters and whether SGLang's
``SamplingParams(**params)`` -> ``normalize()`` -> ``verify(VOCAB_SIZE)`` accepts
them (``sglang``), Omni's decision where Omni is stricter (``omni``, listed in the
`SamplingParams` docstring), and normalised values both must show (``values``; a top_k of -1
is SGLang's TOP_K_ALL).

`STOP_ROWS`: when a request ends (``reason``, ``matched``) after its last output token, the
output being `RowTokenizer` ids (bytes, and merges that make a stop string fewer tokens than
its bytes): stop strings and regexes are searched in SGLang's tail window only.

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


SB = "sglang/srt/managers/schedule_batch.py"
FINISH = f"{SB}:Req.update_finish_state"
TAIL = f"{SB}:Req.tail_str (Req._stop_match_tail_len: the last max_len + 1 tokens)"
STOP_STR_LEN = f"{NORMALIZE} (stop_str_max_len: len(tokenizer.encode(stop)))"
MAX_SEQ_LEN = f"{SP}:get_max_seq_length (unbounded: MAX_LEN = 2**30)"


class RowTokenizer:
    """The stop rows' tokenizer: ids 0-255 are bytes, ids 256 on the `MERGES`, each one token
    for a longer text (as a BPE merge is).

    Why: a stop string's length in tokens (by `encode`, which prefers the longest merge)
    sizes SGLang's tail window, so rows need stop strings shorter in tokens than in the
    output's bytes. `decode` replaces broken UTF-8, as a byte-level BPE tokenizer does.
    """

    MERGES = ("abc", "ca")
    vocab_size = 256 + len(MERGES)
    eos_token_id = None  # what SGLang's Req reads besides encode / decode
    additional_stop_token_ids = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data, ids, at = text.encode("utf-8"), [], 0
        merges = sorted(enumerate(self.MERGES), key=lambda m: -len(m[1]))
        while at < len(data):
            merge = next((i for i, m in merges if data.startswith(m.encode(), at)), None)
            ids.append(data[at] if merge is None else 256 + merge)
            at += 1 if merge is None else len(self.MERGES[merge])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        data = b"".join(bytes([i]) if i < 256 else self.MERGES[i - 256].encode() for i in ids)
        return data.decode("utf-8", errors="replace")


ABC, CA = 256, 257  # RowTokenizer's merges


def _stop(output: bytes | list[int], reason: str | None, matched: int | str | None = None, *,
          eos: tuple[int, ...] = (), terminated: bool = False, source: str = FINISH,
          **params: Any) -> dict[str, Any]:
    return {"params": params, "output": list(output), "eos": list(eos),
            "terminated": terminated, "reason": reason, "matched": matched, "source": source}


# `output` is RowTokenizer ids (bytes, and ABC / CA); one check after the last token, as SGLang
# runs it after each decode step. In SGLang's order: stop strings (list order), stop regexes,
# stop/EOS ids (ignore_eos ignores both), length, a terminated grammar. Strings and regexes are
# searched in the text of the last max(stop_str_max_len, stop_regex_max_len) + 1 tokens only.
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
    # min_new_tokens masks tokens when sampling; the finish check does not read it
    _stop(b"xEND", "stop", "END", stop=["END"], min_new_tokens=8),
    _stop(b"x12", "stop", "[0-9]{2}", stop_regex=["[0-9]{2}"], min_new_tokens=8),
    _stop(b"x\x02", "stop", 2, eos=(2,), min_new_tokens=8),
    # an anchor sees the window's start: ^foo bounds 3 characters, the window is 4 tokens
    _stop(b"xfoo!", "stop", "^foo", stop_regex=["^foo"], source=TAIL),
    _stop(b"xfoo!", "stop", r"\Afoo", stop_regex=[r"\Afoo"], source=TAIL),
    _stop(b"axfoo", "stop", r"\bxfo", stop_regex=[r"\bxfo"], source=TAIL),
    _stop(b"xfoo", None, None, stop_regex=["^foo"], source=TAIL),
    # a match that needs text before the window is not found
    _stop(b"abcd", None, None, stop_regex=["^ab"], source=TAIL),
    _stop("\u00e9\u00e9".encode(), None, None, stop_regex=["\u00e9\u00e9"], source=TAIL),
    # an unbounded regex makes the window the whole output, for the stop strings too
    _stop(b"xyzab", "stop", "^x.*b", stop_regex=["^x.*b"], source=MAX_SEQ_LEN),
    _stop(b"xfoo!", None, None, stop_regex=["^foo", "z+"], source=MAX_SEQ_LEN),
    _stop(b"abcdef", "stop", "^a[^x]", stop_regex=["^a[^x]"], source=MAX_SEQ_LEN),
    _stop(b"abcdef", None, None, stop_regex=["^a[b]"], source=MAX_SEQ_LEN),
    _stop(b"ENDxyzw", None, None, stop=["END"], source=TAIL),
    _stop(b"ENDxyzw", "stop", "END", stop=["END"], stop_regex=["q+"], source=MAX_SEQ_LEN),
    # a stop string's tokens by encode size the window: "cat" is 2 (ca, t), "abc" is 1
    _stop([*b"xy", CA, *b"t"], "stop", "cat", stop=["cat"], source=STOP_STR_LEN),
    _stop(b"xabc", None, None, stop=["abc"], source=STOP_STR_LEN),
    _stop([*b"x", ABC], "stop", "abc", stop=["abc"], source=STOP_STR_LEN),
    _stop(b"xabc", "stop", "abc", stop=["abc"], stop_regex=["[0-9]{3}"], source=STOP_STR_LEN),
    _stop(b"xabc1", "stop", "[0-9]", stop=["abc"], stop_regex=["[0-9]"], source=TAIL),
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
