"""Constrained decoding (xgrammar): every output follows its grammar, with a byte tokenizer and
a BPE tokenizer; constrained and free requests share a batch; bad grammars fail up front."""

import json
import re
import sys
import threading

import jsonschema
import pytest
import torch
import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from omni.compute.engine import TorchEngine
from omni.compute.grammar import GrammarBackend, grammar_spec
from omni.compute.models import tiny_model
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer, HFTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 4},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
REGEX = r"(yes|no|maybe), [0-9]{1,3}( [a-c]+)?"
CORPUS = ['{"name": "Ada", "n": 12, "ok": true}', "yes, 42 abc", "no, 7",
          "The quick brown fox jumps over the lazy dog.", "maybe, 100 cab"] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_tokenizer(directory) -> HFTokenizer:
    """A byte-level BPE trained here on a small corpus (vocab well below the model's 512)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, eos_token_ids=(tok.token_to_id("<|endoftext|>"),))


def make_engine(tokenizer, max_batch: int = 200) -> TorchEngine:
    model, config = tiny_model(seed=0, eos_token_ids=tuple(tokenizer.eos_token_ids))
    return TorchEngine(model, config, tokenizer=tokenizer, max_batch=max_batch)


@pytest.fixture(params=["bytes", "bpe"])
def engine(request, tmp_path):
    tokenizer = ByteTokenizer() if request.param == "bytes" else bpe_tokenizer(tmp_path)
    return make_engine(tokenizer)


async def generate_many(engine, count: int, **fields):
    """`count` concurrent seeded generations at temperature 1.0 (one batch)."""
    results = {}

    async def one(i):
        params = SamplingParams(max_new_tokens=200, temperature=1.0, sampling_seed=i, **fields)
        results[i] = await engine.generate("Answer: ", params)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return [results[i] for i in range(count)]


async def test_200_json_schema_generations_parse_and_validate(engine):
    results = await generate_many(engine, 200, json_schema=json.dumps(SCHEMA))
    for r in results:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert len({r.text for r in results}) > 150  # sampled, not one answer 200 times


async def test_regex_outputs_match_in_full(engine):
    results = await generate_many(engine, 60, regex=REGEX)
    for r in results:
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
    assert {r.text.split(",")[0] for r in results} == {"yes", "no", "maybe"}


async def test_ebnf_and_structural_tag_outputs_follow_them():
    engine = make_engine(ByteTokenizer())
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    for r in await generate_many(engine, 30, ebnf=ebnf):
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", r.text), r.text
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    for r in await generate_many(engine, 3, structural_tag=json.dumps(tag)):
        assert r.text == "hello" and r.finish_reason == "stop"


async def test_a_constrained_and_a_free_request_in_one_batch_equal_each_alone():
    engine = make_engine(ByteTokenizer())
    constrained = SamplingParams(max_new_tokens=40, temperature=1.0, sampling_seed=3,
                                 json_schema=json.dumps(SCHEMA))
    free = SamplingParams(max_new_tokens=40, temperature=1.0, sampling_seed=4)
    together = {}

    async def run(name, params):
        together[name] = await engine.generate("Answer: ", params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "constrained", constrained)
        nursery.start_soon(run, "free", free)
    assert engine.stats().num_prefills == 2
    steps = engine.stats().num_decode_steps
    assert steps < 2 * 39  # they decoded together
    assert together["constrained"].token_ids == (
        await engine.generate("Answer: ", constrained)).token_ids
    assert together["free"].token_ids == (await engine.generate("Answer: ", free)).token_ids
    assert together["free"].token_ids != together["constrained"].token_ids


@pytest.mark.parametrize(("fields", "message"), [
    (dict(json_schema='{"type": "object", "properties": '), r"invalid json_schema: .+"),
    (dict(json_schema='{"type": "integer", "multipleOf": 3}'), r"multipleOf.+not enforce"),
    (dict(regex="(ab"), r"invalid regex: Regex parsing error.+parenthesis"),
    (dict(ebnf="root ::= missing"), r"invalid ebnf: .+missing.+not defined"),
    (dict(structural_tag='{"type": "structural_tag"}'), r"invalid structural_tag: .+format"),
    (dict(regex="a", ebnf='root ::= "a"'), r"only one of .+ got regex, ebnf"),
])
async def test_an_invalid_grammar_fails_the_request_before_anything_runs(fields, message):
    engine = make_engine(ByteTokenizer())
    for _ in range(2):  # the second time from the cache
        with pytest.raises(ValueError, match=message):
            await engine.generate("x", SamplingParams(max_new_tokens=4, **fields))
    assert engine.stats().num_prefills == 0 and engine.scheduler.waiting == []


async def test_grammars_compile_once_in_a_worker_thread(monkeypatch):
    engine = make_engine(ByteTokenizer())
    threads = []
    real = GrammarBackend._compile_uncached

    def spy(self, kind, text):
        threads.append(threading.current_thread())
        return real(self, kind, text)

    monkeypatch.setattr(GrammarBackend, "_compile_uncached", spy)
    params = SamplingParams(max_new_tokens=3, regex="[0-9]+")
    for _ in range(3):
        await engine.generate("x", params)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    stats = engine._grammars.stats()
    assert (stats.num_compiled, stats.num_cache_hits, stats.num_cached) == (1, 2, 1)


def test_the_cache_keeps_the_most_recently_used_grammars():
    backend = GrammarBackend(ByteTokenizer(), 512, [2], cache_size=2)
    for pattern in ["a", "b", "a", "c", "a", "b"]:
        backend.compile("regex", pattern)
    # a, b compiled; a hit; c evicts b; a hit; b compiled again (evicting c)
    assert backend.stats().num_compiled == 4 and backend.stats().num_cache_hits == 2
    assert list(backend._cache) == [("regex", "a"), ("regex", "b")]


def test_the_bitmask_allows_exactly_what_the_grammar_allows_next():
    backend = GrammarBackend(ByteTokenizer(), 512, [2])
    constraint = backend.constraint(backend.compile("regex", "[0-9]{2}"), "regex")
    bitmask = torch.full((3, 16), -1, dtype=torch.int32)

    def allowed(row: int = 1) -> set[int]:
        constraint.fill_bitmask(bitmask, row)
        return {t for t in range(512) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}

    digits = {ord(c) + 3 for c in "0123456789"}
    assert allowed() == digits
    constraint.accept(ord("4") + 3)
    assert allowed() == digits
    constraint.accept(ord("2") + 3)
    assert allowed() == {2} and not constraint.is_terminated()  # only EOS
    constraint.accept(2)
    assert constraint.is_terminated() and constraint.num_accepted == 3
    assert bitmask[0].eq(-1).all() and bitmask[2].eq(-1).all()  # other rows untouched


def test_a_token_outside_the_grammar_ends_it_instead_of_raising():
    backend = GrammarBackend(ByteTokenizer(), 512, [2])
    constraint = backend.constraint(backend.compile("regex", "[0-9]"), "regex")
    constraint.accept(ord("x") + 3)
    assert constraint.is_terminated() and constraint.rejected_token == ord("x") + 3


def test_the_bpe_vocabulary_is_read_from_tokenizer_json(tmp_path):
    import xgrammar

    tokenizer = bpe_tokenizer(tmp_path)
    info = GrammarBackend(tokenizer, 512, tokenizer.eos_token_ids).tokenizer_info
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL and info.vocab_size == 512
    assert info.stop_token_ids == list(tokenizer.eos_token_ids)
    space_id = tokenizer.backend.token_to_id("Ġ")
    assert info.decoded_vocab[space_id] == b" "


def test_grammar_spec_reads_sglang_fields():
    assert grammar_spec(SamplingParams()) is None
    assert grammar_spec(SamplingParams(regex="a+")) == ("regex", "a+")
    assert grammar_spec(SamplingParams(json_schema="")) is None  # empty is unset, as SGLang


async def test_without_xgrammar_a_grammar_request_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    engine = make_engine(ByteTokenizer())
    with pytest.raises(ImportError, match=r"pip install 'omni\[grammar\]'"):
        await engine.generate("x", SamplingParams(max_new_tokens=2, regex="a"))
    free = await engine.generate("x", SamplingParams(max_new_tokens=2))  # others still work
    assert len(free.token_ids) == 2



async def test_n_constrained_samples_each_follow_the_grammar_from_one_prefill():
    engine = make_engine(ByteTokenizer())
    params = dict(max_new_tokens=30, temperature=1.0, regex=REGEX)
    result = await engine.generate("Answer: ", SamplingParams(n=5, sampling_seed=20, **params))
    assert engine.stats().num_prefills == 1 and len(result.samples) == 5
    for i, sample in enumerate(result.samples):  # each sample has its own matcher
        assert re.fullmatch(REGEX, sample.text)
        alone = await engine.generate("Answer: ", SamplingParams(sampling_seed=20 + i, **params))
        assert sample.token_ids == alone.token_ids


async def test_a_grammar_needs_a_tokenizer():
    model, config = tiny_model(seed=0)
    engine = TorchEngine(model, config)
    with pytest.raises(ValueError, match="regex needs a tokenizer"):
        await engine.generate([5, 6], SamplingParams(regex="a"))


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_the_cpu_bitmask_paths_equal_xgrammars_kernel_on_every_row_and_on_some(path):
    """Both CPU paths (xgrammar's kernel where installed, numpy otherwise) mask as xgrammar
    does, and a row allowed nothing keeps only its fallback ids."""
    import xgrammar

    from omni.compute import _logits

    def apply_bitmask_(*args):
        if path == "numpy":
            _logits._apply_bitmask_numpy_(*args)
        else:
            assert _logits._xgrammar_cpu_kernel() is not None
            _logits.apply_bitmask_(*args)

    gen = torch.Generator().manual_seed(5)
    for rows in ([0, 1, 2], [1], [0, 2]):
        logits = torch.randn(3, 100, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int32)
        bitmask[rows[0]] = 0  # allows nothing: only the fallback (EOS) stays
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        expected[rows[0]] = float("-inf")
        expected[rows[0], 2] = logits[rows[0], 2]
        apply_bitmask_(logits, bitmask, rows, lambda row: torch.tensor([2]))
        assert torch.equal(logits, expected)


def test_the_bound_kernel_masks_as_xgrammars_own_and_refuses_other_buffers():
    """`bound_bitmask_kernel` (one call into xgrammar's C++ kernel, set up once per batch
    composition) masks the rows it is given as `xgrammar.apply_token_bitmask_inplace` does;
    buffers it cannot address as they are get None (the caller then uses `apply_bitmask_`)."""
    import xgrammar

    from omni.compute import _logits

    assert _logits._xgrammar_core_kernel() is not None  # this xgrammar has the fast path
    gen = torch.Generator().manual_seed(6)
    scores = torch.empty(3, 100)
    bitmask = torch.empty(3, 4, dtype=torch.int32)
    apply = _logits.bound_bitmask_kernel(scores, bitmask)
    assert apply is not None
    for rows in ([0, 1, 2], [1], [2, 0]):
        scores.copy_(torch.randn(3, 100, generator=gen))
        bitmask.copy_(torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen,
                                    dtype=torch.int32))
        expected = scores.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        apply(rows)
        assert torch.equal(scores, expected)
    bound = _logits.bound_bitmask_kernel
    assert bound(torch.empty(3, 200)[:, ::2], bitmask) is None  # not contiguous
    assert bound(scores.double(), bitmask) is None
    assert bound(scores, bitmask.long()) is None
    assert bound(scores, torch.empty(3, 5, dtype=torch.int32)) is None  # not ceil(V / 32)


@pytest.mark.parametrize("seed", range(4))
def test_the_constraint_knows_when_its_matcher_terminated(seed):
    """`GrammarConstraint` asks its matcher whether it terminated only after a stop token;
    along random walks through a JSON schema, with two EOS ids, it always agrees with the
    matcher, up to and including the stop."""
    backend = GrammarBackend(ByteTokenizer(), 512, [2, 3])
    constraint = backend.constraint(backend.compile("json_schema", json.dumps(SCHEMA)),
                                    "json_schema")
    bitmask = torch.empty(1, 16, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        constraint.fill_bitmask(bitmask, 0)
        allowed = [t for t in range(512) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        # a stop token half the times one is allowed, so that the walk ends
        stops = [t for t in allowed if t in (2, 3)]
        pool = stops if stops and torch.rand(1, generator=gen).item() < 0.5 else allowed
        constraint.accept(pool[int(torch.randint(len(pool), (1,), generator=gen))])
        assert constraint.is_terminated() == constraint._matcher.is_terminated()
        if constraint.is_terminated():
            break
    assert constraint.is_terminated() and constraint.rejected_token is None
