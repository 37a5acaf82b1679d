"""A prompt's cost is bounded before it is paid: a text too long for the context is refused
from its length without being tokenized, and a long text is tokenized off the event loop."""

from __future__ import annotations

import threading

import pytest
from tokenizers import Tokenizer, normalizers

from omni.compute.engine import TOKENIZE_IN_THREAD_CHARS, TorchEngine
from omni.compute.prompt import Prompt, Text
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import HFTokenizer
from tests.compute.checkpoint_builders import trained_tokenizer_json

GREEDY = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)


class CountingTokenizer:
    """The engine's byte tokenizer, noting the threads that encode."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []
        self.eos_token_ids, self.max_token_chars = inner.eos_token_ids, inner.max_token_chars

    def encode(self, text):
        self.threads.append(threading.current_thread())
        return self.inner.encode(text)

    def decode(self, ids, **kwargs):
        return self.inner.decode(ids, **kwargs)


async def test_a_text_longer_than_the_context_is_refused_without_tokenizing_it():
    engine = TorchEngine.tiny(seed=0, store=None)
    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    with pytest.raises(ValueError, match=r"at least 30000000 tokens \(30000000 characters"):
        await engine.generate("x" * 30_000_000, GREEDY)
    with pytest.raises(ValueError, match="at least 4100 tokens"):
        await engine.generate(Prompt([Text("ab" * 1000), Text([5] * 2100)]), GREEDY)
    assert counting.threads == []


async def test_a_long_text_is_tokenized_in_a_worker_thread():
    engine = TorchEngine.tiny(seed=0, store=None, max_position_embeddings=1 << 20)
    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    request = await engine._admit("y" * (TOKENIZE_IN_THREAD_CHARS + 1), GREEDY)
    engine._forget(request)
    await engine.generate("short", GREEDY)
    assert [t is threading.main_thread() for t in counting.threads] == [False, True]


def test_a_tokenizer_bounds_the_text_a_token_covers(tmp_path):
    raw = Tokenizer.from_str(trained_tokenizer_json())
    longest = max(len(t) for t in raw.get_vocab(with_added_tokens=True))
    for normalizer, bound in ((None, longest), (normalizers.NFC(), 4 * longest),
                              (normalizers.Sequence([normalizers.Lowercase(),
                                                     normalizers.NFKC()]), 4 * longest),
                              (normalizers.Strip(), None),
                              (normalizers.Sequence([normalizers.NFC(),
                                                     normalizers.Replace("a", "")]), None)):
        raw.normalizer = normalizer
        raw.save(str(tmp_path / "tokenizer.json"))
        tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
        assert tokenizer.max_token_chars == bound
        if bound is not None:  # the bound holds for a text of the vocabulary's own words
            text = "The quick brown fox. Hello world, how are you today? " * 20
            assert len(tokenizer.encode(text)) >= len(text) / bound
