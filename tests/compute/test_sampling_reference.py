"""TokenSampler's filters against a plain restatement of SGLang's torch sampler (hypothesis).

`reference` restates `top_k_top_p_min_p_sampling_from_probs_torch` (sglang/srt/layers/
sampler.py) with a stable sort, so ties go to the lower token id: Omni's documented order
(SGLang's unstable `torch.sort` keeps it on CPU for rows of up to 16 tokens).
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni.compute.sampling import (
    RequestSamplingState,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
)


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              min_p: float) -> torch.Tensor:
    """SGLang's filtered distribution for one row of logits [V] (renormalised).

    top_k 1 is SGLang's greedy path (`is_all_greedy` in sampling_batch_info.py: argmax of the
    logits in sampler.py), not the sort of probabilities, whose float32 ties could differ.
    """
    if top_k == 1:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    probs = torch.softmax(logits[None] / torch.tensor([[temperature]]), dim=-1)
    if top_k == -1 and top_p == 1.0 and min_p == 0.0:
        return probs[0]
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    mass = ranked.cumsum(dim=-1)
    k = top_k if top_k != -1 else 1 << 30
    ranked[torch.arange(ranked.shape[-1])[None] >= k] = 0.0
    ranked[(mass - ranked) > torch.tensor([[top_p]])] = 0.0
    if min_p > 0:
        ranked[ranked < ranked[:, :1] * torch.tensor([[min_p]])] = 0.0
    dist = torch.zeros_like(probs).scatter_(1, order, ranked)[0]
    return dist / dist.sum()


def omni(logits: torch.Tensor, **params) -> torch.Tensor:
    state = TokenSamplingState([RequestSamplingState(SamplingParams(**params))])
    return TokenSampler().probs(logits[None], state)[0]


LOGITS = st.lists(st.one_of(st.integers(-3, 3).map(float), st.floats(-8, 8, width=32)),
                  min_size=1, max_size=300)


@settings(max_examples=300, deadline=None)
@given(values=LOGITS, temperature=st.sampled_from([0.25, 0.5, 1.0, 1.7]),
       top_k=st.one_of(st.just(-1), st.integers(1, 40)),
       top_p=st.sampled_from([1e-9, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 1e-9, 0.05, 0.25, 0.5, 1.0]))
def test_filters_equal_sglangs_torch_sampler_with_ties_to_the_lower_id(
        values, temperature, top_k, top_p, min_p):
    logits = torch.tensor(values, dtype=torch.float32)
    got = omni(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    want = reference(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-2, 2).map(float), min_size=17, max_size=600),
       top_k=st.integers(1, 20), seed=st.integers(0, 2**32))
def test_rows_keep_their_filters_whatever_else_is_in_the_batch(values, top_k, seed):
    logits = torch.tensor(values)
    alone = omni(logits, top_k=top_k)
    others = [SamplingParams(top_p=0.3), SamplingParams(temperature=0),
              SamplingParams(top_k=1000, min_p=0.1), SamplingParams(sampling_seed=seed)]
    state = TokenSamplingState([RequestSamplingState(p) for p in
                                [others[0], SamplingParams(top_k=top_k), *others[1:]]])
    batched = TokenSampler().probs(logits.expand(5, -1), state)[1]
    assert torch.equal(batched, alone)
