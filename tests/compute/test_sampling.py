"""Sampling parameters, the token sampler's stages and stop rules (omni.compute.sampling)."""

import dataclasses
import json
import math
import pickle

import pytest
import torch

from omni.compute.sampling import (
    RequestSamplingState,
    Sampler,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
    truncate_at_stop,
)

# Four tokens whose probabilities at temperature 1 are, in vocab order: 0.15, 0.5, 0.05, 0.3.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


def batch(*params: SamplingParams, prompts=None) -> TokenSamplingState:
    prompts = prompts or [()] * len(params)
    rows = zip(params, prompts, strict=True)
    return TokenSamplingState([RequestSamplingState(p, prompt) for p, prompt in rows])


def dist(logits: torch.Tensor, **kw) -> torch.Tensor:
    """The single-row distribution TokenSampler draws from under SamplingParams(**kw)."""
    return TokenSampler().probs(logits[None], batch(SamplingParams(**kw)))[0]


def keep(*token_ids: int) -> torch.Tensor:
    """PROBS restricted to token_ids and renormalised: the hand-computed filtered distribution."""
    mask = torch.zeros(4, dtype=torch.bool)
    mask[list(token_ids)] = True
    kept = torch.where(mask, PROBS, 0.0)
    return kept / kept.sum()


# ---------------------------------------------------------------------------- SamplingParams

BAD_VALUES = [
    ("max_new_tokens", -1, ">= 0"), ("max_new_tokens", True, "int"), ("max_new_tokens", 1.5, "int"),
    ("temperature", -0.1, ">= 0"), ("temperature", "0.7", "number"), ("temperature", math.nan,
                                                                      "finite"),
    ("temperature", math.inf, "finite"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_p", "1", "number"), ("top_k", 0, "-1 (off) or >= 1"), ("top_k", -2, "-1 (off)"),
    ("top_k", 2.0, "int"), ("top_k", False, "int"), ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.1, "[0, 1]"), ("repetition_penalty", 0.0, "(0, 2]"),
    ("repetition_penalty", 2.5, "(0, 2]"), ("frequency_penalty", -2.5, "[-2, 2]"),
    ("frequency_penalty", 2.1, "[-2, 2]"), ("presence_penalty", 3, "[-2, 2]"),
    ("presence_penalty", -3.0, "[-2, 2]"), ("stop", 5, "string"), ("stop", [""], "non-empty"),
    ("stop", ["a", 3], "string"), ("sampling_seed", 2**63, "[-2**63, 2**63 - 1]"),
    ("stop_token_ids", [True], "ints"), ("stop_token_ids", "12", "list"),
    ("ignore_eos", 1, "bool"), ("sampling_seed", "1", "int"), ("sampling_seed", True, "int"),
]


@pytest.mark.parametrize(("field", "value", "accepted"), BAD_VALUES)
def test_bad_value_raises_value_error_naming_field_and_range(field, value, accepted):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and accepted in str(info.value)


def test_error_message_states_range_and_value():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("kw", [
    {"max_new_tokens": 0}, {"temperature": 0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": -1},
    {"top_k": 1}, {"min_p": 0.0}, {"min_p": 1.0}, {"repetition_penalty": 2.0},
    {"frequency_penalty": -2}, {"presence_penalty": 2}, {"sampling_seed": -5},
    {"sampling_seed": 2**63 - 1}, {"sampling_seed": -(2**63)}, {"stop_token_ids": [-1]},
])
def test_boundary_values_are_accepted(kw):
    SamplingParams(**kw)


def test_defaults_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), frozenset(), False)
    assert p.sampling_seed is None


def test_stop_and_stop_token_ids_are_normalised_and_numbers_coerced():
    p = SamplingParams(stop="###", stop_token_ids=[7, 3, 7], temperature=1)
    assert p.stop == ("###",) and p.stop_token_ids == frozenset({3, 7})
    assert type(p.temperature) is float
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    assert SamplingParams(stop=(s for s in "xy"), stop_token_ids=iter([1])).stop == ("x", "y")


def test_params_are_frozen_keyword_only_and_hashable():
    p = SamplingParams(top_k=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(128)  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(top_k=5))
    rich = SamplingParams(logit_bias={"1": 2}, custom_params={"ids": [1, 2]}, stop="x")
    assert hash(rich) == hash(SamplingParams(logit_bias={1: 2.0}, custom_params={"ids": [1, 2]},
                                             stop=["x"]))
    assert pickle.loads(pickle.dumps(rich)) == rich and rich.logit_bias == {"1": 2.0}
    with pytest.raises(TypeError):
        rich.logit_bias["1"] = 3.0  # type: ignore[index]


def test_is_greedy_for_temperature_below_sglang_epsilon_or_top_k_one():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01, top_k=2).is_greedy


def test_to_dict_round_trips_through_json():
    p = SamplingParams(temperature=0.5, stop=["x", "y"], stop_token_ids=[9, 2], sampling_seed=3)
    data = json.loads(json.dumps(p.to_dict()))
    assert data["stop_token_ids"] == [2, 9] and SamplingParams.from_dict(data) == p


def test_from_dict_rejects_unknown_keys_by_name_and_non_mappings():
    with pytest.raises(ValueError, match=r"'bogus', 'zz'"):
        SamplingParams.from_dict({"temperature": 0.5, "zz": 2, "bogus": 1})
    with pytest.raises(ValueError, match="'sampling_seed'"):
        SamplingParams.from_dict({"seed": 3})
    with pytest.raises(ValueError, match="does not support: 'beam_width'"):
        SamplingParams.from_dict({"beam_width": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- protocol

def test_token_sampler_and_a_diffusion_sampler_both_satisfy_sampler():
    class EulerStep:  # a diffusion sampler: model output -> next latents
        def step(self, output: torch.Tensor, state: float) -> torch.Tensor:
            return output * state

    assert isinstance(TokenSampler(), Sampler) and isinstance(EulerStep(), Sampler)


# --------------------------------------------------------------------------- token sampler

def test_all_greedy_batch_takes_the_argmax_fast_path_and_records_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    state, sampler = batch(*[SamplingParams(temperature=0)] * 3), TokenSampler()
    tokens = sampler.step(logits, state)
    assert torch.equal(tokens, logits.argmax(-1)) and sampler.num_fast_steps == 1
    assert [r.output_token_ids for r in state.requests] == [[t] for t in tokens.tolist()]
    assert repr(sampler) == "<TokenSampler steps=1 fast=1>"


def test_tiny_temperature_equals_argmax():
    logits = torch.randn(20, 100, generator=torch.Generator().manual_seed(1))
    state = batch(*[SamplingParams(temperature=1e-4, sampling_seed=i) for i in range(20)])
    assert torch.equal(TokenSampler().step(logits, state), logits.argmax(-1))


def test_temperature_scales_logits_before_softmax_and_high_temperature_spreads():
    assert torch.allclose(dist(LOGITS, temperature=0.5), torch.softmax(LOGITS / 0.5, -1))
    hot = dist(LOGITS, temperature=100.0)
    assert torch.allclose(hot, torch.full((4,), 0.25), atol=0.01)
    assert hot.max() < PROBS.max() and dist(LOGITS, temperature=0.1).max() > 0.99


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    state = batch(*[SamplingParams(top_k=1, sampling_seed=i) for i in range(4)])
    assert torch.equal(TokenSampler().step(logits, state), logits.argmax(-1))


def test_top_k_keeps_the_k_most_likely_exactly():
    assert torch.allclose(dist(LOGITS, top_k=2), keep(1, 3))
    assert torch.allclose(dist(LOGITS, top_k=10), PROBS)  # k beyond the vocab keeps all


def test_top_k_never_samples_outside_the_top_k_over_many_seeds():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    top = set(logits.topk(5).indices.tolist())
    state = batch(*[SamplingParams(top_k=5, temperature=2.0, sampling_seed=s) for s in range(500)])
    tokens = TokenSampler().step(logits.expand(500, -1), state)
    assert set(tokens.tolist()) == top


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, (1,)), (0.6, (1, 3)), (0.9, (0, 1, 3)),
                                             (0.99, (0, 1, 2, 3)), (1.0, (0, 1, 2, 3))])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    assert torch.allclose(dist(LOGITS, top_p=top_p), keep(*kept))


@pytest.mark.parametrize(("min_p", "kept"), [(0.05, (0, 1, 2, 3)), (0.2, (0, 1, 3)),
                                             (0.4, (1, 3)), (1.0, (1,))])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, kept):
    assert torch.allclose(dist(LOGITS, min_p=min_p), keep(*kept))


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Hand computation: keep each token whose more likely tokens sum to less than top_p."""
    ranked = probs.sort(descending=True).values
    mass_before = ranked.cumsum(0) - ranked
    cutoff = ranked[(mass_before < top_p).sum() - 1]
    kept = torch.where(probs >= cutoff, probs, 0.0)
    return kept / kept.sum()


def test_top_p_widens_its_prefix_when_the_cutoff_lies_beyond_it():
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 0.1  # nearly flat
    state = batch(SamplingParams(top_p=0.5), SamplingParams(top_k=5))
    probs = TokenSampler().probs(logits.expand(2, -1), state)
    assert state.sort_width == 2048  # 256 was too narrow for ~1500 kept tokens
    assert torch.allclose(probs[0], reference_top_p(torch.softmax(logits, -1), 0.5))
    assert int((probs[0] > 0).sum()) > 1000 and int((probs[1] > 0).sum()) == 5


def test_filters_intersect_on_the_same_distribution():
    assert torch.allclose(dist(LOGITS, top_k=3, top_p=0.6), keep(1, 3))
    assert torch.allclose(dist(LOGITS, top_k=2, min_p=0.2, top_p=0.9), keep(1, 3))


def test_masked_logits_get_exactly_zero_and_tiny_ones_keep_softmaxs_value():
    logits = torch.tensor([0.0, -math.inf, -50.0, -200.0])
    probs = dist(logits, temperature=1.0)
    assert probs[1] == 0 and probs[3] == 0  # e^-200 underflows float32, as in torch.softmax
    assert math.isclose(probs[2].item(), math.exp(-50), rel_tol=1e-4)
    state = batch(*[SamplingParams(temperature=50.0, sampling_seed=s) for s in range(200)])
    assert 1 not in TokenSampler().step(logits.expand(200, -1), state).tolist()


def test_rows_in_one_batch_each_get_their_own_filters():
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.6),
              SamplingParams(temperature=0), SamplingParams(min_p=0.4, top_k=3)]
    probs = TokenSampler().probs(LOGITS.expand(5, -1), batch(*params))
    expected = [keep(1, 3), PROBS, keep(1, 3), keep(1), keep(1, 3)]
    assert torch.allclose(probs, torch.stack(expected))


def test_sampled_frequencies_match_the_filtered_distribution():
    state = batch(*[SamplingParams(top_p=0.9, sampling_seed=s) for s in range(4000)])
    tokens = TokenSampler().step(LOGITS.expand(4000, -1), state)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, keep(0, 1, 3), atol=0.03) and freq[2] == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_output_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    request = RequestSamplingState(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[2, 3])
    request.output_token_ids.extend([0, 1, 99])  # 99: not in V; the prompt is not penalised
    probs = TokenSampler().probs(logits[None], TokenSamplingState([request]))[0]
    expected = torch.softmax(torch.tensor([1.0, -4.0, 1.0, 0.5]), -1)
    assert torch.allclose(probs, expected) and probs[0] < torch.softmax(logits, -1)[0]


def test_repetition_penalty_counts_output_tokens_once_sampled():
    state = batch(SamplingParams(temperature=0, repetition_penalty=2.0))
    sampler, logits = TokenSampler(), torch.tensor([[2.0, 1.5, 0.0]])
    assert [sampler.step(logits, state).item() for _ in range(3)] == [0, 1, 0]  # 2 -> 1 < 1.5


def test_frequency_penalty_grows_with_count_and_presence_penalty_applies_once():
    logits = torch.zeros(4)
    request = RequestSamplingState(SamplingParams(frequency_penalty=0.5), prompt_token_ids=[2])
    request.output_token_ids.extend([0, 0, 0, 1])  # history a new batch composition rebuilds
    probs = TokenSampler().probs(logits[None], TokenSamplingState([request]))[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor([-1.5, -0.5, 0.0, 0.0]), -1))
    request = RequestSamplingState(SamplingParams(presence_penalty=0.5), prompt_token_ids=[2])
    request.output_token_ids.extend([0, 0, 0, 1])
    probs = TokenSampler().probs(logits[None], TokenSamplingState([request]))[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor([-0.5, -0.5, 0.0, 0.0]), -1))


def test_presence_penalty_steers_greedy_decoding_away_from_used_tokens():
    state = batch(SamplingParams(temperature=0, presence_penalty=2.0))
    sampler, logits = TokenSampler(), torch.tensor([[1.0, 0.5, 0.0]])
    # 1-2 < 0.5, then 0.5-2 < 0.0, then all used: [-1, -1.5, -2] however often 0 repeats
    assert [sampler.step(logits, state).item() for _ in range(5)] == [0, 1, 2, 0, 0]
    assert sampler.num_fast_steps == 0


def test_greedy_rows_in_a_sampled_batch_take_the_argmax_of_penalised_logits():
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0], [0.0, 0.0, 5.0]])
    state = batch(SamplingParams(temperature=0, repetition_penalty=2.0),
                  SamplingParams(sampling_seed=0), SamplingParams(top_k=1))
    state.requests[0].output_token_ids.append(0)
    tokens = TokenSampler().step(logits, state)
    assert tokens[0] == 1 and tokens[2] == 2  # 2.0 / 2 < 1.9


def test_probs_does_not_advance_the_state():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(sampling_seed=3, frequency_penalty=1.0),
              SamplingParams(sampling_seed=4, top_p=0.8)]
    state, sampler = batch(*params), TokenSampler()
    sampler.probs(logits, state)
    assert [r.output_token_ids for r in state.requests] == [[], []]
    assert torch.equal(sampler.step(logits, state), TokenSampler().step(logits, batch(*params)))


def test_steps_reuse_the_states_scratch_buffers():
    state, sampler = batch(SamplingParams(top_p=0.9, repetition_penalty=1.2)), TokenSampler()
    sampler.step(torch.randn(1, 64), state)
    buffers = [b.data_ptr() for b in state.scratch()]
    sampler.step(torch.randn(1, 64), state)
    assert [b.data_ptr() for b in state.scratch()] == buffers


def test_penalties_leave_the_callers_logits_untouched():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    before = logits.clone()
    state = batch(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), prompts=[[0, 1]])
    TokenSampler().step(logits, state)
    assert torch.equal(logits, before)


def decode(rows: list[SamplingParams], steps: int, row_of_interest: int) -> list[int]:
    """Sample `steps` tokens for a batch; the row of interest always sees the same logits."""
    state, sampler = batch(*rows), TokenSampler()
    noise = torch.Generator().manual_seed(99)
    for t in range(steps):
        logits = torch.randn(len(rows), 1000, generator=noise)
        logits[row_of_interest] = torch.randn(1000, generator=torch.Generator().manual_seed(t))
        sampler.step(logits, state)
    return state.requests[row_of_interest].output_token_ids


def test_seeded_row_gives_the_same_tokens_alone_and_inside_any_batch():
    me = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.2,
                        sampling_seed=7)
    alone = decode([me], 30, 0)
    others = [SamplingParams(temperature=0), SamplingParams(sampling_seed=1, frequency_penalty=1.0),
              SamplingParams(top_p=0.5), SamplingParams(top_k=3, min_p=0.1)]
    assert decode([others[0], me, *others[1:]], 30, 1) == alone
    assert decode([*others[2:], me], 30, 2) == alone
    assert decode([me], 30, 0) == alone


def test_different_seeds_and_unseeded_rows_give_different_tokens():
    seeded = decode([SamplingParams(sampling_seed=1)], 30, 0)
    assert decode([SamplingParams(sampling_seed=2)], 30, 0) != seeded
    assert decode([SamplingParams()], 30, 0) != decode([SamplingParams()], 30, 0)


def test_half_precision_logits_are_sampled_in_float32():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    state = batch(SamplingParams(temperature=0), SamplingParams(sampling_seed=0))
    tokens = TokenSampler().step(logits, state)
    assert tokens.dtype == torch.int64 and tokens[0] == logits[0].float().argmax()


def test_logits_of_the_wrong_shape_or_a_changed_vocab_raise_value_error():
    state, sampler = batch(SamplingParams(), SamplingParams()), TokenSampler()
    with pytest.raises(ValueError, match=r"expected logits \[2, V\]"):
        sampler.step(torch.zeros(3, 10), state)
    sampler.step(torch.zeros(2, 10), state)
    with pytest.raises(ValueError, match="vocab size changed"):
        sampler.step(torch.zeros(2, 11), state)


# ------------------------------------------------------------------------------ stop rules

def test_stop_token_id_and_eos_finish_with_stop():
    request = RequestSamplingState(SamplingParams(stop_token_ids=[5]))
    request.output_token_ids.append(5)
    assert request.check_stop(5, eos_token_ids={2}) == "stop" and request.matched_stop == 5
    request = RequestSamplingState(SamplingParams())
    request.output_token_ids.append(2)
    assert request.check_stop(2, eos_token_ids={2}) == "stop"
    assert request.check_stop(3, eos_token_ids={2}) is None and request.finish_reason is None


def test_ignore_eos_skips_eos_and_stop_token_ids_as_sglang_does():
    request = RequestSamplingState(SamplingParams(ignore_eos=True, stop_token_ids=[5],
                                                  stop=["x"]), eos_token_ids=[3])
    request.output_token_ids.append(2)
    assert request.check_stop(2, eos_token_ids={2}) is None
    assert request.check_stop(3) is None and request.check_stop(5, eos_token_ids={2}) is None
    assert request.check_stop(5, "ax") == "stop"  # stop strings still apply


def test_eos_on_the_last_allowed_token_finishes_with_stop_as_sglang_does():
    request = RequestSamplingState(SamplingParams(max_new_tokens=2))
    request.output_token_ids.append(7)
    assert request.check_stop(7) is None
    request.output_token_ids.append(2)
    assert request.check_stop(2, eos_token_ids={2}) == "stop"
    assert request.check_stop(4, eos_token_ids={2}) == "length"
    assert RequestSamplingState(SamplingParams(max_new_tokens=0)).finish_reason == "length"


def test_no_max_new_tokens_runs_until_the_context_is_full():
    request = RequestSamplingState(SamplingParams(max_new_tokens=None), [1, 2, 3],
                                   context_length=6)
    request.output_token_ids.extend([4, 4])
    assert request.check_stop(4) is None
    request.output_token_ids.append(4)
    assert request.check_stop(4) == "length"


def test_stop_string_finishes_and_output_is_truncated_before_it():
    request = RequestSamplingState(SamplingParams(stop=["END", "\n\n"]))
    request.output_token_ids.append(1)
    assert request.check_stop(1, "Hello E") is None
    assert request.check_stop(1, "Hello\n\nEND more") == "stop"
    assert request.matched_stop == "END"  # the first in list order, as SGLang checks them
    assert truncate_at_stop("Hello END more\n\n", request.params.stop) == "Hello "
    assert truncate_at_stop("Hello\n\nEND more", request.params.stop) == "Hello"
    assert truncate_at_stop("no stop here", ("END",)) == "no stop here"


def test_decode_loop_stops_on_eos_and_records_the_reason():
    request = RequestSamplingState(SamplingParams(temperature=0, max_new_tokens=10), [1, 2])
    state, sampler = TokenSamplingState([request]), TokenSampler()
    for step_logits in ([0.0, 1.0, 0.0], [0.0, 0.0, 1.0]):
        token = sampler.step(torch.tensor([step_logits]), state).item()
        reason = request.check_stop(token, eos_token_ids={2})
    assert request.output_token_ids == [1, 2] and reason == "stop"
    assert repr(request) == "<RequestSamplingState prompt=2 output=2 finish=stop>"
