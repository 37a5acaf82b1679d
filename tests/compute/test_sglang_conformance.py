"""Omni's SamplingParams and TokenSampler against every row of SGLang's conformance table."""

import pytest
import torch

from omni.compute.sampling import (
    RequestSamplingState,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
)
from omni.compute.sglang_backend import to_sglang_params
from tests.compute.sglang_conformance import (
    PARAM_ROWS,
    SAMPLING_ROWS,
    STOP_ROWS,
    VOCAB_SIZE,
    RowTokenizer,
    expected_distribution,
    row_logits,
)


def _row_id(row: dict) -> str:
    return repr(row["params"])[:60]


@pytest.mark.parametrize("row", PARAM_ROWS, ids=_row_id)
def test_params_row_is_accepted_or_rejected_as_the_table_says(row):
    """Omni accepts exactly what SGLang accepts, except the rows where Omni is stricter."""
    if not row["omni"]:
        with pytest.raises(ValueError):
            SamplingParams.from_dict(row["params"]).verify(VOCAB_SIZE)
        return
    params = SamplingParams.from_dict(row["params"]).verify(VOCAB_SIZE)
    for name, value in row["values"].items():
        assert getattr(params, name) == value, name
    assert SamplingParams.from_dict(to_sglang_params(params)) == params


def test_the_table_covers_every_field_and_both_decisions():
    fields = {name for row in PARAM_ROWS for name in row["params"]}
    own = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "n",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed",
           "stop", "stop_token_ids", "stop_regex", "logit_bias", "json_schema", "regex", "ebnf",
           "structural_tag", "ignore_eos", "skip_special_tokens", "no_stop_trim",
           "spaces_between_special_tokens", "stream_interval", "custom_params"}
    assert own <= fields
    assert {row["sglang"] for row in PARAM_ROWS} == {True, False}
    assert all(row["source"] for row in PARAM_ROWS + SAMPLING_ROWS)


@pytest.mark.parametrize("row", SAMPLING_ROWS, ids=lambda r: f"{r['source'][-30:]}-{r['params']}")
def test_sampling_row_gives_sglangs_distribution(row):
    """Kept set and distribution of Omni's sampler equal the row's (SGLang's) result."""
    params = SamplingParams(**row["params"])
    request = RequestSamplingState(params, row["prompt"], eos_token_ids=row["eos"])
    request.output_token_ids.extend(row["output"])
    probs = TokenSampler().probs(row_logits(row)[None], TokenSamplingState([request]))[0]
    assert sorted(torch.nonzero(probs).flatten().tolist()) == sorted(row["kept"])
    expected = expected_distribution(row, 0.0 if params.is_greedy else params.temperature)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_issue_examples_hold_in_the_table():
    """The cases that differed before: exact top-k, top-p's <= rule, output-only penalties."""
    by_key = {(tuple(r["logits"] or r["probs"]), repr(r["params"]), tuple(r["prompt"])): r
              for r in SAMPLING_ROWS}
    assert by_key[((3, 2, 2, 2, 1, 0), "{'top_k': 2}", ())]["kept"] == [0, 1]
    assert by_key[((0.4, 0.2, 0.2, 0.2), "{'top_p': 0.5}", ())]["kept"] == [0, 1]
    assert by_key[((0.5, 0.25, 0.25), "{'top_p': 0.5}", ())]["kept"] == [0, 1]
    row = by_key[((2, 1, 0), "{'repetition_penalty': 2.0}", (0,))]
    probs = expected_distribution(row, 1.0)
    assert torch.allclose(probs, torch.tensor([0.665, 0.245, 0.090]), atol=5e-3)


class _Terminated:
    """A constraint that is complete."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def accept(self, token_id):
        pass

    def is_terminated(self):
        return True


def _stop_row_id(row: dict) -> str:
    return f"{RowTokenizer().decode(row['output'])!r}-{row['params']}"


@pytest.mark.parametrize("row", STOP_ROWS, ids=_stop_row_id)
def test_stop_row_ends_the_request_as_sglang_does(row):
    """The finish, searching stop strings and regexes in the text of the tail window only."""
    constraint = _Terminated() if row["terminated"] else None
    tokenizer = RowTokenizer()
    request = RequestSamplingState(SamplingParams(**row["params"]), eos_token_ids=row["eos"],
                                   constraint=constraint, encode=tokenizer.encode)
    request.output_token_ids.extend(row["output"])
    tail = request.stop_tail_ids()
    text = tokenizer.decode(tail) if tail else None
    assert request.check_stop(row["output"][-1], text) == row["reason"]
    assert request.matched_stop == row["matched"]


def test_the_stop_rows_cover_the_tail_window():
    """Rows where the window's text and the whole output's text disagree, both ways."""
    tokenizer, disagree = RowTokenizer(), {"stop": 0, None: 0}
    for row in STOP_ROWS:
        request = RequestSamplingState(SamplingParams(**row["params"]), eos_token_ids=row["eos"])
        request.output_token_ids.extend(row["output"])
        whole = request.check_stop(row["output"][-1], tokenizer.decode(row["output"]))
        if whole != row["reason"]:
            disagree[row["reason"]] += 1
    assert disagree["stop"] >= 3 and disagree[None] >= 3, disagree
