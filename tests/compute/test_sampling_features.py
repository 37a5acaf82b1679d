"""logit_bias, min_new_tokens, token constraints and custom logit processors in TokenSampler."""

import math

import pytest
import torch

from omni.compute.sampling import (
    LogitProcessor,
    RequestSamplingState,
    SamplingParams,
    TokenConstraint,
    TokenSampler,
    TokenSamplingState,
)

EOS = 0


def run(requests: list[RequestSamplingState], logits: torch.Tensor, steps: int,
        rebuild: bool = False) -> list[list[int]]:
    """Decode `steps` tokens with the same logits [B, V] every step."""
    sampler, state = TokenSampler(), TokenSamplingState(requests)
    for _ in range(steps):
        if rebuild:  # a new composition each step: tables rebuilt from the histories
            state = TokenSamplingState(requests)
        sampler.step(logits, state)
    return [r.output_token_ids for r in requests]


class Sequence:
    """A constraint that allows exactly `tokens`, in order, then is terminated."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.accepted = tokens, []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        token = self.tokens[len(self.accepted)]
        word, bit = divmod(token, 32)
        bitmask[row, word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)

    def accept(self, token_id: int) -> None:
        assert token_id == self.tokens[len(self.accepted)], (token_id, self.tokens)
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return len(self.accepted) == len(self.tokens)


class Nothing(Sequence):
    """A constraint that allows no token at all."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def test_logit_bias_is_added_and_minus_inf_bans_a_token():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    state = TokenSamplingState([RequestSamplingState(SamplingParams(logit_bias={"2": 5.0}))])
    probs = TokenSampler().probs(logits, state)[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor([2.0, 1.0, 5.0]), -1))
    state = TokenSamplingState([RequestSamplingState(
        SamplingParams(logit_bias={"0": -math.inf}, temperature=0))])
    assert TokenSampler().step(logits, state).item() == 1


def test_logit_bias_outside_the_vocabulary_raises_value_error():
    state = TokenSamplingState([RequestSamplingState(SamplingParams(logit_bias={"3": 1.0}))])
    with pytest.raises(ValueError, match=r"logit_bias keys must be in \[0, 2\], got 3"):
        TokenSampler().step(torch.zeros(1, 3), state)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1.0}).verify(3)
    with pytest.raises(ValueError, match="logit_bias"):
        RequestSamplingState(SamplingParams(logit_bias={"3": 1.0}), vocab_size=3)


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # greedy prefers EOS, then stop id 1
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[1])
    request = RequestSamplingState(params, eos_token_ids=[EOS])
    tokens = run([request], logits, 3)[0]
    assert tokens == [2, 2, EOS]
    assert request.check_stop(EOS) == "stop"


def test_constraint_masks_the_row_and_accepts_each_token():
    constraint = Sequence([3, 40, 63, 33])  # words 0 and 1, bit 31 (the int32 sign bit)
    request = RequestSamplingState(SamplingParams(sampling_seed=1), constraint=constraint)
    logits = torch.randn(1, 70, generator=torch.Generator().manual_seed(0))
    assert run([request], logits, 4)[0] == [3, 40, 63, 33] == constraint.accepted
    assert request.check_stop(33) == "stop" and request.matched_stop == 33


def test_constrained_and_free_rows_share_a_batch_without_changing_each_other():
    logits = torch.randn(2, 70, generator=torch.Generator().manual_seed(1))

    def requests():
        return [RequestSamplingState(SamplingParams(sampling_seed=5, temperature=0.7),
                                     constraint=Sequence([7, 8, 9, 10, 11])),
                RequestSamplingState(SamplingParams(sampling_seed=6, top_p=0.9))]

    together = run(requests(), logits, 5)
    alone = [run([requests()[i]], logits[i:i + 1], 5)[0] for i in range(2)]
    assert together == alone and together[0] == [7, 8, 9, 10, 11]


def test_a_constraint_that_allows_nothing_takes_eos_without_nan():
    request = RequestSamplingState(SamplingParams(), eos_token_ids=[EOS],
                                   constraint=Nothing([1]))
    probs = TokenSampler().probs(torch.randn(1, 40), TokenSamplingState([request]))[0]
    assert probs[EOS] == 1.0 and not torch.isnan(probs).any()
    # greedy rows (found from the row maxima): the dead row takes EOS, the others their argmax
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    rows = [RequestSamplingState(SamplingParams(temperature=0), eos_token_ids=[39],
                                 constraint=c) for c in (Sequence([7]), Nothing([1]), None)]
    tokens = TokenSampler().step(logits, TokenSamplingState(rows)).tolist()
    assert tokens == [7, 39, int(logits[2].argmax())]


def test_a_grammar_allowing_only_eos_during_min_new_tokens_still_takes_eos():
    request = RequestSamplingState(SamplingParams(min_new_tokens=3), eos_token_ids=[EOS],
                                   constraint=Sequence([EOS]))
    probs = TokenSampler().probs(torch.randn(1, 40), TokenSamplingState([request]))[0]
    assert probs[EOS] == 1.0 and not torch.isnan(probs).any()
    request = RequestSamplingState(SamplingParams(logit_bias={str(t): -math.inf
                                                              for t in range(4)}))
    probs = TokenSampler().probs(torch.randn(1, 4), TokenSamplingState([request]))[0]
    assert torch.allclose(probs, torch.full((4,), 0.25))  # no EOS known: any token


def test_constraints_are_protocols():
    assert isinstance(Sequence([1]), TokenConstraint)


class BanFirstParam:
    """A processor in SGLang's CustomLogitProcessor style: bans custom_params['ban']."""

    def __init__(self):
        self.calls = []

    def __call__(self, logits, custom_param_list):
        self.calls.append([None if p is None else {k: v for k, v in p.items() if k != "__req__"}
                           for p in custom_param_list])
        for i, params in enumerate(custom_param_list):
            if params is not None:
                logits[i, params["ban"]] = -math.inf
                assert params["__req__"].output_ids == params["__req__"].output_token_ids
        return logits


def test_logit_processor_runs_once_per_step_for_its_rows_with_their_custom_params():
    processor = BanFirstParam()
    assert isinstance(processor, LogitProcessor)
    requests = [RequestSamplingState(SamplingParams(temperature=0, custom_params={"ban": 0}),
                                     logit_processor=processor),
                RequestSamplingState(SamplingParams(temperature=0)),
                RequestSamplingState(SamplingParams(temperature=0), logit_processor=processor)]
    tokens = run(requests, torch.tensor([[3.0, 2.0, 1.0]] * 3), 2)
    assert tokens == [[1, 1], [0, 0], [0, 0]]
    assert processor.calls == [[{"ban": 0}, None]] * 2


def test_a_processor_returning_the_wrong_shape_raises_value_error():
    request = RequestSamplingState(SamplingParams(), logit_processor=lambda x, p: x[:, :2])
    with pytest.raises(ValueError, match="returned shape"):
        TokenSampler().step(torch.zeros(1, 3), TokenSamplingState([request]))


def test_penalty_tables_rebuilt_from_history_equal_the_incremental_ones():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))

    def requests():
        return [RequestSamplingState(SamplingParams(
            sampling_seed=s, frequency_penalty=0.3, presence_penalty=0.2,
            repetition_penalty=1.3, temperature=0.8)) for s in (1, 2)]

    assert run(requests(), logits, 12) == run(requests(), logits, 12, rebuild=True)


def test_bitmask_application_equals_xgrammars_own():
    """Omni's mask for the constrained rows equals xgrammar.apply_token_bitmask_inplace."""
    import xgrammar  # the grammar extra, which `make` installs

    from omni.compute._logits import apply_bitmask_

    gen = torch.Generator().manual_seed(3)
    for vocab_size in (32, 70, 1000):
        words = (vocab_size + 31) // 32
        logits = torch.randn(4, vocab_size, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), generator=gen, dtype=torch.int32)
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2, 3])
        apply_bitmask_(logits, bitmask, torch.tensor([0, 2, 3]), lambda row: torch.tensor([0]))
        assert torch.equal(logits, expected)


class Fixed:
    """A constraint whose mask is a fixed random bitmask row (never terminated)."""

    def __init__(self, words: torch.Tensor):
        self.words, self.accepted = words, []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = self.words
        return bool((self.words != -1).any())

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return False


def test_greedy_constrained_rows_equal_masking_every_row_first():
    """The greedy path that tests each row's argmax against its mask (and masks only the rows
    whose argmax is forbidden, or masks first for a while after one was) takes the tokens a
    full mask + argmax takes at every step, ties included."""
    gen = torch.Generator().manual_seed(11)
    for vocab_size in (33, 70, 512):
        words = (vocab_size + 31) // 32
        masks = torch.randint(-2**31, 2**31 - 1, (4, words), generator=gen, dtype=torch.int32)
        masks[0] = -1  # a row allowing every token
        rows = [RequestSamplingState(SamplingParams(temperature=0), eos_token_ids=[EOS],
                                     constraint=Fixed(masks[i]) if i != 3 else None)
                for i in range(4)]
        allowed = ((masks[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool()
        allowed = allowed.view(4, -1)[:, :vocab_size]
        allowed[3] = True
        sampler, state = TokenSampler(), TokenSamplingState(rows)
        for step in range(60):
            logits = torch.randint(0, 4, (4, vocab_size), generator=gen).float()  # many ties
            if step % 20 < 10:  # stretches where every argmax is allowed
                logits[allowed] += 10
            expected = logits.masked_fill(~allowed, -math.inf).argmax(dim=-1)
            assert sampler.step(logits, state).tolist() == expected.tolist(), step
        assert [len(r.output_token_ids) for r in rows] == [60] * 4
