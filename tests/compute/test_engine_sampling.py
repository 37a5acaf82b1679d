"""SGLang's sampling fields through TorchEngine: EOS ids for min_new_tokens, vocab checks,
stop regexes and strings searched in SGLang's tail window."""

import re

import pytest

from omni.compute.engine import TorchEngine
from omni.compute.models import tiny_model
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def engine():
    return TorchEngine.tiny(seed=0)


async def test_min_new_tokens_holds_back_the_models_eos(engine):
    eos = engine.config.eos_token_ids[0]
    # with the EOS id as the greedy first token, the request ends at once without a minimum
    biased = SamplingParams(max_new_tokens=8, temperature=0, logit_bias={str(eos): 1e4})
    assert (await engine.generate("hello", biased)).token_ids == [eos]
    held = SamplingParams(max_new_tokens=8, temperature=0, logit_bias={str(eos): 1e4},
                          min_new_tokens=3)
    result = await engine.generate("hello", held)
    assert eos not in result.token_ids[:3] and result.token_ids[3] == eos
    assert result.finish_reason == "stop"


async def test_a_logit_bias_outside_the_vocabulary_fails_only_that_request(engine):
    bad = SamplingParams(logit_bias={str(engine.config.vocab_size): 1.0})
    with pytest.raises(ValueError, match="logit_bias keys must be in"):
        await engine.generate("hello", bad)
    assert (await engine.generate("hello", SamplingParams(max_new_tokens=2))).token_ids


class CountingTokenizer(ByteTokenizer):
    """A byte tokenizer that records how many ids each decode was given."""

    def __init__(self):
        self.decoded: list[int] = []

    def decode(self, token_ids, **options):
        self.decoded.append(len(token_ids))
        return super().decode(token_ids, **options)


def tail_match(token_ids, pattern: str, window: int) -> int | None:
    """The fewest leading tokens after which `pattern` is found in the text of the last
    `window` of them (special tokens kept), or None."""
    tok = ByteTokenizer()
    return next((k for k in range(1, len(token_ids) + 1) if re.search(
        pattern, tok.decode(token_ids[max(0, k - window):k], skip_special_tokens=False))),
        None)


FREE = dict(max_new_tokens=24, temperature=0, ignore_eos=True)


async def test_an_anchored_stop_regex_matches_at_the_tail_window_s_start(engine):
    """\\A + 2 characters bounds 2: the engine searches the last 3 tokens only, so the anchor
    matches where the window starts, which a search of the whole output never does."""
    free = (await engine.generate("anchored", SamplingParams(**FREE))).token_ids
    printable = [35 <= t < 130 for t in free]  # one ASCII character each
    at = next(i for i in range(1, len(free) - 2) if printable[i] and printable[i + 1])
    tok = ByteTokenizer()
    pattern = r"\A" + re.escape(tok.decode(free[at:at + 2]))
    assert not re.search(pattern, tok.decode(free, skip_special_tokens=False))
    k = tail_match(free, pattern, window=3)
    assert k is not None and k <= at + 3
    stopped = await engine.generate("anchored", SamplingParams(**FREE, stop_regex=pattern))
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", free[:k])
    assert stopped.text == tok.decode(free[:k])  # the pattern's text is not in it: no cut


async def test_an_unbounded_stop_regex_widens_the_window_to_the_whole_output(engine):
    """With `x+` beside it (unbounded: SGLang's 2**30) the anchored regex sees the output's
    start, where it does not match: the request runs to its length."""
    free = (await engine.generate("anchored", SamplingParams(**FREE))).token_ids
    tok = ByteTokenizer()
    text = tok.decode(free, skip_special_tokens=False)
    pattern = r"\A" + re.escape(text[-2:])
    unbounded = "(?:" + re.escape(chr(0x2603)) + ")+"  # a snowman: not in the output
    assert not re.search(pattern, text) and not re.search(unbounded, text)
    assert tail_match(free, pattern, window=3) is not None  # alone, it would stop
    result = await engine.generate("anchored", SamplingParams(
        **FREE, stop_regex=[pattern, unbounded]))
    assert (result.finish_reason, result.token_ids) == ("length", free)


async def test_stop_checks_decode_the_tail_window_only():
    """A 3-token stop string: every step decodes at most 4 ids, however long the output."""
    model, config = tiny_model(seed=0)
    tokenizer = CountingTokenizer()
    engine = TorchEngine(model, config, tokenizer=tokenizer, store=None)
    result = await engine.generate("anchored", SamplingParams(
        **FREE, stop=chr(0x2603)))  # 3 UTF-8 bytes: 3 tokens, a window of 4
    assert result.finish_reason == "length" and len(result.token_ids) == 24
    checks, final = tokenizer.decoded[:-1], tokenizer.decoded[-1]
    assert len(checks) == 24 and max(checks) == 4 and final == 24


async def test_stop_strings_without_a_tokenizer_are_refused():
    """As SGLang without a tokenizer: stop and stop_regex cannot be read, so they are refused
    (stop_token_ids still work)."""
    model, config = tiny_model(seed=0)
    engine = TorchEngine(model, config, tokenizer=None, store=None)
    for params in (SamplingParams(stop="x"), SamplingParams(stop_regex="x+")):
        with pytest.raises(ValueError, match="stop and stop_regex need a tokenizer"):
            await engine.generate([5, 6, 7], params)
    free = (await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8,
                                                             temperature=0))).token_ids
    assert len(free) == 8  # no EOS in the way
    stopped = await engine.generate([5, 6, 7], SamplingParams(
        max_new_tokens=8, temperature=0, stop_token_ids=[free[2]]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free[:free.index(free[2]) + 1]
