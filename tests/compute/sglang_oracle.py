"""Check the conformance table against SGLang's own code (needs an importable `sglang`).

``python -m tests.compute.sglang_oracle`` feeds every row of tests/compute/sglang_conformance.py
to SGLang 0.5.23: parameter rows to ``SamplingParams(**p)`` -> ``normalize(None)`` (a
stand-in tokenizer where stop strings, stop regexes or min_new_tokens need one) ->
``verify(VOCAB_SIZE)`` (and, for rows Omni accepts, Omni's `to_sglang_params` output too);
sampling rows through SGLang's penalizers (penaltylib, accumulated as
``SamplingBatchInfo.update_penalties`` does), ``SamplingBatchInfo.apply_logits_bias``, the
temperature division and softmax of ``Sampler.forward``, and
``top_k_top_p_min_p_sampling_from_probs_torch``, whose source is read from the installed
``sglang/srt/layers/sampler.py`` (that module's import pulls in GPU kernels); stop rows
through ``Req.update_finish_state`` and its helpers (``tail_str``, ``_stop_match_tail_len``),
compiled from the installed ``sglang/srt/managers/schedule_batch.py``, with the rows'
`RowTokenizer`, comparing also the tail of output ids each side decodes; and Omni's
`regex_max_length` against ``get_max_seq_length``. Prints one line per disagreement and a
summary; exits 1 if any row disagrees.

SGLang without its GPU stack, in a scratch folder (the modules its imports reach)::

    pip install --no-deps --target /tmp/sgl sglang==0.5.23 orjson psutil pybase64 triton \
        IPython traitlets aiohttp multidict yarl propcache aiohappyeyeballs aiosignal \
        frozenlist partial_json_parser dill
    PYTHONPATH=$PWD:/tmp/sgl python -m tests.compute.sglang_oracle
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import torch

from tests.compute.sglang_conformance import (
    PARAM_ROWS,
    SAMPLING_ROWS,
    STOP_ROWS,
    VOCAB_SIZE,
    RowTokenizer,
    expected_distribution,
    row_logits,
)

TOP_K_ALL = 1 << 30


class _Tokenizer:
    """What `normalize` and the min_new_tokens penalizer read from SGLang's tokenizer."""

    eos_token_id = None
    additional_stop_token_ids = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


def _needs_tokenizer(params: dict[str, Any]) -> bool:
    """Stop strings, stop regexes and min_new_tokens need SGLang's tokenizer
    (`raise_if_tokenizer_required`): `normalize(None)` refuses them."""
    return bool(params.get("stop") or params.get("stop_regex")
                or (params.get("min_new_tokens") or 0) > 0)


def sglang_accepts(params: dict[str, Any]) -> tuple[bool, Any]:
    """SGLang's decision on `params`, and its normalised SamplingParams when accepted.

    ``normalize(None)`` (no tokenizer), except for the features that need one, which are
    normalised with a stand-in tokenizer, as a server with a tokenizer does.
    """
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        sp = SamplingParams(**params)
        sp.normalize(_Tokenizer() if _needs_tokenizer(params) else None)
        sp.verify(VOCAB_SIZE)
    except Exception:  # SGLang raises ValueError, TypeError or re.error
        return False, None
    return True, sp


def _sglang_value(sp: Any, name: str) -> Any:
    value = getattr(sp, name)
    return -1 if name == "top_k" and value == TOP_K_ALL else value


def check_param_row(row: dict[str, Any]) -> list[str]:
    """Disagreements between the row and SGLang (empty when SGLang agrees)."""
    from omni.compute.sampling_params import SamplingParams
    from omni.compute.sglang_backend import to_sglang_params

    accepted, sp = sglang_accepts(row["params"])
    problems = [] if accepted == row["sglang"] else [f"SGLang accepted={accepted}"]
    for name, value in row["values"].items() if accepted else ():
        if _sglang_value(sp, name) != value:
            problems.append(f"{name}: SGLang has {_sglang_value(sp, name)!r}, table {value!r}")
    if row["omni"]:
        omni = to_sglang_params(SamplingParams.from_dict(row["params"]))
        if not sglang_accepts(omni)[0]:
            problems.append(f"SGLang rejects Omni's to_sglang_params output {omni!r}")
    return problems


def load_torch_sampler() -> Any:
    """`top_k_top_p_min_p_sampling_from_probs_torch`, compiled from SGLang's installed source."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/layers/sampler.py"
    tree = ast.parse(path.read_text())
    name = "top_k_top_p_min_p_sampling_from_probs_torch"
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict[str, Any] = {"torch": torch, "Optional": __import__("typing").Optional}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


class _Batch:
    """The part of SGLang's ScheduleBatch its penalizer orchestrator reads."""

    def __init__(self, reqs: list[Any]):
        self.reqs, self.device = reqs, "cpu"


class _Req:
    """The part of SGLang's Req its penalizers read."""

    def __init__(self, sp: Any, eos: list[int]):
        self.sampling_params, self.eos_token_ids, self.tokenizer = sp, set(eos), _Tokenizer()


def sglang_scores(row: dict[str, Any], sp: Any) -> torch.Tensor:
    """The row's logits after SGLang's penalties and logit_bias: [1, V]."""
    from sglang.srt.sampling import penaltylib
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    logits = row_logits(row)[None].clone()
    vocab_size = logits.shape[1]
    batch = _Batch([_Req(sp, row["eos"])])
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(
        vocab_size=vocab_size, batch=batch,
        penalizers={penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
                    penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})
    for token in row["output"]:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    bias = None
    if sp.logit_bias is not None:  # as SamplingBatchInfo.from_schedule_batch builds it
        bias = torch.zeros(1, vocab_size)
        for key, value in {int(k): v for k, v in sp.logit_bias.items()}.items():
            bias[0, key] = value
    one = torch.ones(1)
    info = SamplingBatchInfo(
        temperatures=torch.tensor([[sp.temperature]]), top_ps=one, top_ks=one.int(),
        min_ps=one, is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=vocab_size,
        penalizer_orchestrator=orchestrator, device="cpu", logit_bias=bias)
    info = info.copy_for_forward()  # update_penalties: additive, then scaling
    info.apply_logits_bias(logits)
    return logits


def sglang_distribution(row: dict[str, Any], sampler: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, the distribution SGLang draws from) for a sampling row."""
    accepted, sp = sglang_accepts(row["params"])
    assert accepted, f"SGLang rejects {row['params']!r}"
    scores = sglang_scores(row, sp)
    if sp.top_k <= 1:  # Sampler.forward: is_all_greedy -> argmax
        return scores[0], torch.nn.functional.one_hot(scores.argmax(-1)[0], scores.shape[1])
    probs = torch.softmax(scores / torch.tensor([[sp.temperature]]), dim=-1)
    if sp.top_p == 1.0 and sp.top_k == TOP_K_ALL and sp.min_p == 0:
        return scores[0], probs[0]  # the simple sampling case: no filter
    _, filtered, order, _ = sampler(
        probs.clone(), torch.tensor([sp.top_k], dtype=torch.int32), torch.tensor([sp.top_p]),
        torch.tensor([sp.min_p]), sp.min_p > 0, None, torch.zeros(1, dtype=torch.int64),
        return_filtered_probs=True)
    dist = torch.zeros_like(probs).scatter_(1, order.long(), filtered)[0]
    return scores[0], dist / dist.sum()


def check_sampling_row(row: dict[str, Any], sampler: Any) -> list[str]:
    """Disagreements between the row's scores / kept set / distribution and SGLang's."""
    scores, dist = sglang_distribution(row, sampler)
    problems = []
    table_scores = torch.tensor(row["scores"], dtype=torch.float32)
    if not torch.allclose(scores, table_scores, atol=1e-6, equal_nan=False) and not all(
            math.isclose(a, b, abs_tol=1e-6) or a == b for a, b in
            zip(scores.tolist(), table_scores.tolist(), strict=True)):
        problems.append(f"scores: SGLang {scores.tolist()}, table {row['scores']}")
    kept = sorted(torch.nonzero(dist).flatten().tolist())
    if kept != sorted(row["kept"]):
        problems.append(f"kept: SGLang {kept}, table {sorted(row['kept'])}")
    temperature = row["params"].get("temperature", 1.0)
    greedy = temperature < 1e-6 or row["params"].get("top_k") == 1
    expected = expected_distribution(row, 0.0 if greedy else temperature)
    if not problems and not torch.allclose(dist.float(), expected, atol=1e-6):
        problems.append(f"distribution: SGLang {dist.tolist()}, table {expected.tolist()}")
    return problems


def random_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Random sampling rows (no table facts): logits, params and outputs drawn with `seed`."""
    rng, rows = torch.Generator().manual_seed(seed), []
    for _ in range(count):
        vocab_size = int(torch.randint(2, 400, (1,), generator=rng))
        logits = (torch.randn(vocab_size, generator=rng) * 3).tolist()
        draw = torch.rand(8, generator=rng).tolist()
        params = {"temperature": round(0.2 + 1.5 * draw[0], 3),
                  "top_p": 1.0 if draw[1] < 0.3 else round(draw[1], 3),
                  "top_k": -1 if draw[2] < 0.3 else 1 + int(draw[2] * vocab_size),
                  "min_p": 0.0 if draw[3] < 0.5 else round(draw[3] / 4, 3),
                  "repetition_penalty": round(0.5 + 1.5 * draw[4], 3),
                  "frequency_penalty": round(4 * draw[5] - 2, 3),
                  "presence_penalty": round(4 * draw[6] - 2, 3)}
        output = torch.randint(0, vocab_size, (int(draw[7] * 20),), generator=rng).tolist()
        rows.append({"logits": logits, "probs": None, "params": params, "prompt": [],
                     "output": output, "eos": []})
    return rows


def check_random_row(row: dict[str, Any], sampler: Any) -> list[str]:
    """Omni's distribution against SGLang's for a random row (to 1e-6)."""
    from omni.compute.sampling import (
        RequestSamplingState,
        SamplingParams,
        TokenSampler,
        TokenSamplingState,
    )

    request = RequestSamplingState(SamplingParams(**row["params"]), row["prompt"])
    request.output_token_ids.extend(row["output"])
    logits = torch.tensor(row["logits"])[None]
    omni = TokenSampler().probs(logits, TokenSamplingState([request]))[0]
    _, dist = sglang_distribution(row, sampler)
    if torch.equal(omni > 0, dist > 0) and torch.allclose(omni, dist.float(), atol=1e-6):
        return []
    return [f"Omni keeps {int((omni > 0).sum())}, SGLang {int((dist > 0).sum())}; "
            f"max difference {float((omni - dist).abs().max()):.2e}"]


_REQ_METHODS = ("finished", "update_finish_state", "_check_vocab_boundary_finish",
                "_check_str_based_finish", "_check_token_based_finish",
                "_cap_finished_len_at_max_new_tokens", "_locate_str_stop_finished_len",
                "tail_str", "_stop_match_tail_len")


def load_finish_check() -> type:
    """A class with SGLang's `Req` finish methods and finish reasons, compiled from the
    installed sglang/srt/managers/schedule_batch.py (that module's import needs torchvision)."""
    import http
    import logging
    import re
    import typing

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/managers/schedule_batch.py"
    tree = ast.parse(path.read_text())
    reasons = [n for n in tree.body if isinstance(n, ast.ClassDef)
               and (n.name == "BaseFinishReason" or n.name.startswith("FINISH"))]
    req = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Req")
    methods = [n for n in req.body if isinstance(n, ast.FunctionDef) and n.name in _REQ_METHODS]
    assert len(methods) == len(_REQ_METHODS), "SGLang's Req changed"
    namespace: dict[str, Any] = {**vars(typing), "re": re, "HTTPStatus": http.HTTPStatus,
                                 "logger": logging.getLogger("sglang_oracle")}
    module = ast.Module(body=[*reasons, ast.ClassDef(
        name="Req", bases=[], keywords=[], body=methods, decorator_list=[])],
        type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
    return namespace["Req"]


class _Grammar:
    def __init__(self, terminated: bool):
        self.terminated = terminated

    def is_terminated(self) -> bool:
        return self.terminated


def check_stop_row(row: dict[str, Any], req_class: type) -> list[str]:
    """Disagreements between the row's finish and SGLang's `Req.update_finish_state` (which
    searches the text of `Req.tail_str`), and between the tail window Omni decodes and
    SGLang's `_stop_match_tail_len`."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from omni.compute.sampling import RequestSamplingState
    from omni.compute.sampling import SamplingParams as OmniParams

    sp = SamplingParams(**row["params"])
    sp.normalize(RowTokenizer())
    req = req_class()
    req.sampling_params, req.output_ids = sp, list(row["output"])
    req.eos_token_ids, req.tokenizer = set(row["eos"]), RowTokenizer()
    req.decoded_text, req.vocab_size = "", RowTokenizer.vocab_size
    req.finished_reason = req.finished_len = req.to_finish = None
    req.grammar = _Grammar(row["terminated"])
    has_text = bool(sp.stop_strs or sp.stop_regex_strs)
    sglang_tail = req.output_ids[-req._stop_match_tail_len(1):] if has_text else []
    req.update_finish_state(1)
    finish = req.finished_reason
    reason = None if finish is None else "length" if hasattr(finish, "length") else "stop"
    matched = getattr(finish, "matched", None)
    problems = [] if (reason, matched) == (row["reason"], row["matched"]) else [
        f"SGLang finishes with {reason!r} matching {matched!r}"]
    omni = RequestSamplingState(OmniParams(**row["params"]), encode=RowTokenizer().encode)
    omni.output_token_ids.extend(row["output"])
    if omni.stop_tail_ids() != sglang_tail:
        problems.append(f"SGLang decodes {sglang_tail}, Omni {omni.stop_tail_ids()}")
    return problems


# patterns whose bound differs by construct: anchors, repeats, branches, and what SGLang's
# get_max_seq_length does not know (NOT_LITERAL, lookarounds, atomic groups, backreferences)
REGEX_LENGTH_PATTERNS = ("^foo", r"\Afoo\Z", r"\bx\B", "a+", "a*?", ".*x", "a{2,5}", "a{3}",
                         "(a|bc){3}", "a|bcd", "(?:ab)+", "[^a]", r"\d\w\s", "(?<=a)b",
                         "(?!a)b", "(?>ab)", "a*+", r"(a)\1", "(?i)abc", "\u00e9\u00e9")


def check_regex_lengths() -> list[str]:
    """Omni's `regex_max_length` against SGLang's `get_max_seq_length`, for the stop rows'
    regexes and `REGEX_LENGTH_PATTERNS`."""
    from sglang.srt.sampling.sampling_params import get_max_seq_length

    from omni.compute._stop import regex_max_length

    patterns = {p for row in STOP_ROWS for p in row["params"].get("stop_regex", ())}
    return [f"regex {p!r}: SGLang bounds it {get_max_seq_length(p)}, Omni "
            f"{regex_max_length(p)}" for p in sorted(patterns | set(REGEX_LENGTH_PATTERNS))
            if get_max_seq_length(p) != regex_max_length(p)]


def random_param_dicts(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Parameter dicts mixing each field's boundary values (from the table's rows)."""
    import random

    pool: dict[str, list[Any]] = {}
    for row in PARAM_ROWS:
        for name, value in row["params"].items():
            if name not in ("seed", "beam_width"):
                pool.setdefault(name, []).append(value)
    rng = random.Random(seed)
    return [{name: rng.choice(values) for name, values in rng.sample(sorted(pool.items()), 4)}
            for _ in range(count)]


def check_random_params(params: dict[str, Any]) -> list[str]:
    """What Omni accepts, SGLang accepts, also as Omni's `to_sglang_params` output."""
    from omni.compute.sampling_params import SamplingParams
    from omni.compute.sglang_backend import to_sglang_params

    try:
        omni = SamplingParams.from_dict(params).verify(VOCAB_SIZE)
    except ValueError:
        return []
    problems = [] if sglang_accepts(params)[0] else ["Omni accepts what SGLang rejects"]
    if not sglang_accepts(to_sglang_params(omni))[0]:
        problems.append("SGLang rejects Omni's to_sglang_params output")
    return problems


def run(num_random: int = 300) -> tuple[int, list[str]]:
    """(rows checked, one line per disagreement): the table, then `num_random` random sampling
    rows and as many random parameter dicts."""
    sampler, req_class, failures = load_torch_sampler(), load_finish_check(), []
    for row in PARAM_ROWS:
        failures += [f"params {row['params']!r}: {p}" for p in check_param_row(row)]
    for row in SAMPLING_ROWS:
        label = f"sampling {row['logits'] or row['probs']} {row['params']}"
        failures += [f"{label}: {p}" for p in check_sampling_row(row, sampler)]
    for i, row in enumerate(random_rows(num_random)):
        failures += [f"random row {i} {row['params']}: {p}"
                     for p in check_random_row(row, sampler)]
    for row in STOP_ROWS:
        label = f"stop {RowTokenizer().decode(row['output'])!r} {row['params']}"
        failures += [f"{label}: {p}" for p in check_stop_row(row, req_class)]
    failures += check_regex_lengths()
    for params in random_param_dicts(num_random):
        failures += [f"random params {params!r}: {p}" for p in check_random_params(params)]
    checked = len(PARAM_ROWS) + len(SAMPLING_ROWS) + len(STOP_ROWS) + 2 * num_random
    return checked, failures


def main() -> int:
    """Print the disagreements and a summary line; 1 if any row disagrees."""
    checked, failures = run()
    for line in failures:
        print(line)
    print(f"{checked} rows checked against SGLang, all agree" if not failures
          else f"{len(failures)} disagreement(s) in {checked} rows")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
