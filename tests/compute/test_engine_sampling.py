"""SGLang's sampling fields through TorchEngine: EOS ids for min_new_tokens, vocab checks."""

import pytest

from omni.compute.engine import TorchEngine
from omni.compute.sampling import SamplingParams


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
