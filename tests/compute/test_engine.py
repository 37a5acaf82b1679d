"""TorchEngine: reused KV gives the recomputed tokens exactly; batching, streaming, bad input."""

import re
import threading

import numpy as np
import pytest
import torch
import trio
import trio.testing

from omni.compute.engine import TorchEngine
from omni.compute.models import save_pretrained, tiny_model
from omni.compute.prompt import Audio, Image, Prompt, Text
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer
from omni.kv import KVStore, TierConfig

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = "You are a helpful assistant who answers in one short sentence. "


@pytest.fixture
def reference():
    """The same model without a store: every token recomputed."""
    return TorchEngine.tiny(seed=0, store=None)


@pytest.fixture
def engine(tmp_path):
    layout = TorchEngine.tiny(seed=0).kv_layout
    store = KVStore(layout, [TierConfig("device", 64 * layout.page_bytes),
                             TierConfig("host", 256 * layout.page_bytes)])
    yield TorchEngine.tiny(seed=0, store=store)
    store.close()


def pixels(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)


async def test_a_second_turn_reuses_the_first_and_equals_recomputation(engine, reference):
    first = await engine.generate(SYSTEM + "What is Omni?", GREEDY)
    assert first.cached_tokens == 0
    follow_up = SYSTEM + "What is Omni?" + first.text + " And why?"
    second = await engine.generate(follow_up, GREEDY)
    assert second.cached_tokens > 0
    assert second.cached_tokens % engine.page_size == 0
    assert second.cached_tokens >= (len(first.token_ids) + first.prompt_tokens) // 16 * 16 - 16
    assert second.token_ids == (await reference.generate(follow_up, GREEDY)).token_ids


async def test_another_conversation_with_the_same_system_prompt_reuses_it(engine, reference):
    await engine.generate(SYSTEM + "Hello!", GREEDY)
    other = await engine.generate(SYSTEM + "Tell me a joke.", GREEDY)
    assert other.cached_tokens == len(SYSTEM.encode()) // 16 * 16
    assert other.token_ids == (await reference.generate(SYSTEM + "Tell me a joke.",
                                                       GREEDY)).token_ids


@pytest.mark.parametrize("media", [Image(pixels()), Audio(np.sin(np.arange(3000) / 7.0))],
                         ids=["image", "audio"])
async def test_media_prompts_are_reused_and_equal_recomputation(engine, reference, media):
    prompt = Prompt([Text(SYSTEM), media, Text("Describe it.")])
    first = await engine.generate(prompt, GREEDY)
    again = await engine.generate(prompt + Text(" Briefly."), GREEDY)
    assert again.cached_tokens > first.prompt_tokens - 16
    recomputed = await reference.generate(prompt + Text(" Briefly."), GREEDY)
    assert again.token_ids == recomputed.token_ids


async def test_one_changed_pixel_shares_no_page_from_the_image_on(engine):
    changed = pixels()
    changed[3, 4, 1] ^= 1
    intro = "An image: "  # 10 tokens, then the image's 16 positions
    await engine.generate(Prompt([Text(intro * 4), Image(pixels()), Text("What?")]), GREEDY)
    result = await engine.generate(Prompt([Text(intro * 4), Image(changed), Text("What?")]),
                                   GREEDY)
    assert result.cached_tokens == 32  # the two pages before the image's first page


async def test_images_and_audio_change_the_output(reference):
    a = await reference.generate(Prompt([Image(pixels(1)), Text("What?")]), GREEDY)
    b = await reference.generate(Prompt([Image(pixels(2)), Text("What?")]), GREEDY)
    assert a.token_ids != b.token_ids


async def test_concurrent_requests_are_batched_and_match_single_runs(engine, reference):
    prompts = [f"request {i}: " + "tell me more " * (i + 1) for i in range(6)]
    results = {}

    async def one(i):
        results[i] = await engine.generate(prompts[i], GREEDY)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == (await reference.generate(prompt, GREEDY)).token_ids
    assert engine.scheduler.running == [] and engine.scheduler.waiting == []


async def test_forward_passes_run_off_the_event_loop(reference):
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await reference.generate("x" * 200, SamplingParams(max_new_tokens=30, temperature=0))
        nursery.cancel_scope.cancel()
    assert len(ticks) > 30


async def test_stream_yields_the_tokens_generate_returns(reference):
    streamed = [t async for t in reference.stream("streaming please", GREEDY)]
    assert streamed == (await reference.generate("streaming please", GREEDY)).token_ids


async def test_a_stream_reports_its_cache_use_like_generate(engine):
    prompt = "a prompt long enough to fill a few pages of sixteen tokens"
    first = engine.stream(prompt, GREEDY)
    assert first.cached_tokens is None and first.result is None  # nothing ran yet
    tokens = [t async for t in first]
    assert first.result.token_ids == tokens and first.result.cached_tokens == 0
    again = engine.stream(prompt, GREEDY)
    async for _ in again:
        assert again.cached_tokens == (len(prompt) - 1) // 16 * 16  # known from the 1st token
        break
    await again.aclose()
    generated = await engine.generate(prompt, GREEDY)
    assert generated.cached_tokens > 0 and generated.token_ids == tokens


async def test_cancelling_one_request_leaves_the_others_running(engine, reference):
    done = {}

    async def long_one():
        await engine.generate("a long request " * 5, SamplingParams(max_new_tokens=3000,
                                                                     temperature=0,
                                                                     ignore_eos=True))

    async def short_one():
        done["short"] = await engine.generate("short", GREEDY)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(short_one)
        with trio.move_on_after(0.2):
            await long_one()
    assert done["short"].token_ids == (await reference.generate("short", GREEDY)).token_ids
    assert engine.scheduler.running == []


async def test_a_request_cancelled_while_its_step_prefills_it_leaves_the_engine_serving(
        reference, monkeypatch):
    """Two requests start in one step: the first drives it (its task waits for the worker
    thread), the second is parked, so a cancel reaches the second while the step prefills it.
    Its row must still get its first token (or the step's decode finds a row without one)."""
    entered, release = threading.Event(), threading.Event()
    forward, prefills = reference.model.forward, []

    def gated(hidden, positions, past=None, mask=None, deepstack=None):
        if hidden.shape[1] > 1:
            prefills.append(hidden.shape[1])
            if len(prefills) == 2:  # the second request's prefill
                entered.set()
                release.wait(60)
        return forward(hidden, positions, past, mask, deepstack)

    monkeypatch.setattr(reference.model, "forward", gated)
    scopes = [trio.CancelScope(), trio.CancelScope()]

    async def request(i: int) -> None:
        with scopes[i]:
            await reference.generate(f"request number {i}", GREEDY)

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(request, i)
        await trio.to_thread.run_sync(entered.wait, 60)
        for scope in scopes:
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()  # the parked request has taken its cancel
        release.set()
    assert len(prefills) == 2
    after = await reference.generate("request number 0", GREEDY)  # its step drops theirs
    assert len(after.token_ids) == GREEDY.max_new_tokens and reference.scheduler.running == []


async def test_sampling_is_reproducible_with_a_seed(reference):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, sampling_seed=7)
    a = await reference.generate("seeded", params)
    b = await reference.generate("seeded", params)
    assert a.token_ids == b.token_ids


async def test_max_new_tokens_and_stop_token_ids_end_generation(reference):
    first = await reference.generate("stop here", GREEDY)
    stop_at = first.token_ids[3]
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_at])
    stopped = await reference.generate("stop here", params)
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert len(stopped.token_ids) == first.token_ids.index(stop_at) + 1
    assert first.finish_reason == "length" and len(first.token_ids) == 12


async def test_bad_input_gets_clear_errors(engine):
    with pytest.raises(ValueError, match="this model's context is 4096 tokens"):
        await engine.generate([5] * 5000, GREEDY)
    with pytest.raises(ValueError, match="the prompt is empty"):
        await engine.generate("", GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await engine.generate([10 ** 6], GREEDY)
    with pytest.raises(ValueError, match=r"Image must be an \[H, W, 3\] RGB array"):
        Image(np.zeros((3, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match="Image must be uint8"):
        Image(np.zeros((8, 8, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="Audio must be a non-empty 1-D array"):
        Audio(np.zeros((2, 100)))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)


def test_a_store_of_another_layout_is_refused(tmp_path):
    other = TorchEngine.tiny(seed=0, page_size=8).kv_layout
    with KVStore(other, [TierConfig("host", 16 * other.page_bytes)]) as store, \
            pytest.raises(ValueError, match="does not match the model's"):
        TorchEngine.tiny(seed=0, store=store, page_size=16)


async def test_from_pretrained_matches_transformers_generate(tmp_path):
    """The oracle at the engine level: greedy tokens equal HF's for the same weights."""
    from transformers import AutoModelForCausalLM

    model, config = tiny_model(seed=3)
    save_pretrained(model, config, tmp_path)
    engine = TorchEngine.from_pretrained(tmp_path)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    ours = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0,
                                                        ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt):].tolist()


async def test_n_samples_share_one_prefill_and_equal_separately_seeded_requests(reference):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=11, n=4)
    result = await reference.generate("four samples, one prefill", params)
    assert reference.stats().num_prefills == 1 and len(result.samples) == 4
    assert result.samples[0] is result
    for i, sample in enumerate(result.samples):
        alone = await reference.generate("four samples, one prefill", SamplingParams(
            max_new_tokens=10, temperature=1.0, sampling_seed=11 + i))
        assert (sample.token_ids, sample.text) == (alone.token_ids, alone.text)
    assert len({tuple(s.token_ids) for s in result.samples}) > 1
    assert reference.stats().num_prefills == 5
    assert reference.scheduler.running == [] and reference.runner.batch.size == 0


async def test_n_samples_with_a_store_put_each_sample_s_pages(engine, reference):
    prompt = SYSTEM + "Two ways to say it?"
    params = SamplingParams(max_new_tokens=40, temperature=1.0, sampling_seed=5, n=2,
                            ignore_eos=True)
    result = await engine.generate(prompt, params)
    assert result.samples[0].token_ids != result.samples[1].token_ids
    for sample in result.samples:  # each sample's own history is cached for its next turn
        follow_up = ByteTokenizer().encode(prompt) + sample.token_ids
        again = await engine.generate(follow_up, GREEDY)
        assert again.cached_tokens == (len(follow_up) - 1) // 16 * 16
        assert again.token_ids == (await reference.generate(follow_up, GREEDY)).token_ids


def first_match(token_ids, found, window: int) -> int:
    """The fewest leading tokens after which the text of the last `window` of them (special
    tokens kept: SGLang's tail window) satisfies `found`."""
    tok = ByteTokenizer()
    return next(k for k in range(1, len(token_ids) + 1)
                if found(tok.decode(token_ids[max(0, k - window):k], skip_special_tokens=False)))


def ascii_pair(token_ids) -> int:
    """The first index of two tokens in a row that are each one printable ASCII character."""
    printable = [35 <= t < 130 for t in token_ids]  # ByteTokenizer: byte + 3
    return next(i for i in range(len(token_ids) - 1) if printable[i] and printable[i + 1])


async def test_stop_regex_ends_at_the_token_that_completes_the_match(reference):
    free = (await reference.generate("regex stops", GREEDY)).token_ids
    tok = ByteTokenizer()
    pattern = "(?:" + re.escape(tok.decode(free[:8])[-2:]) + ")"  # 2 characters: 3 tokens
    k = first_match(free, lambda text: re.search(pattern, text), window=3)
    stopped = await reference.generate("regex stops", SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, stop_regex=[r"\A\Z", pattern]))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:k]
    assert stopped.text == tok.decode(free[:k])  # as SGLang: the match stays in the text


async def test_no_stop_trim_keeps_the_stop_token_and_the_stop_string(reference):
    free = (await reference.generate("trim or keep", SamplingParams(
        max_new_tokens=12, temperature=0))).token_ids
    assert len(free) == 12  # no EOS in the way
    tok = ByteTokenizer()
    by_token = dict(max_new_tokens=12, temperature=0, stop_token_ids=[free[5]])
    k = free.index(free[5]) + 1
    trimmed = await reference.generate("trim or keep", SamplingParams(**by_token))
    kept = await reference.generate("trim or keep", SamplingParams(**by_token,
                                                                   no_stop_trim=True))
    assert trimmed.token_ids == kept.token_ids == free[:k]
    assert (trimmed.text, kept.text) == (tok.decode(free[:k - 1]), tok.decode(free[:k]))
    at = ascii_pair(free)
    stop = tok.decode(free[at:at + 2])  # 2 tokens by encode: a window of 3
    k = first_match(free, lambda text: stop in text, window=3)
    assert k <= at + 2
    text = tok.decode(free[:k])
    at = text.find(stop)
    by_string = dict(max_new_tokens=12, temperature=0, stop=stop)
    trimmed = await reference.generate("trim or keep", SamplingParams(**by_string))
    kept = await reference.generate("trim or keep", SamplingParams(**by_string,
                                                                   no_stop_trim=True))
    assert trimmed.token_ids == kept.token_ids == free[:k]
    assert (trimmed.text, kept.text) == (text[:at], text[:at + len(stop)])


async def test_stream_interval_hands_tokens_over_in_groups(reference):
    params = SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True,
                            stream_interval=4)
    stream = reference.stream("grouped tokens", params)
    made = []  # how many tokens existed when each one was handed over
    async for _ in stream:
        made.append(len(stream._request.output))
    alone = await reference.generate("grouped tokens", SamplingParams(
        max_new_tokens=14, temperature=0, ignore_eos=True))
    assert stream.result.token_ids == alone.token_ids
    groups = [made.count(n) for n in sorted(set(made))]
    assert sum(groups) == 14 and all(size >= 4 for size in groups[1:-1]), groups


async def test_n_and_stop_regex_errors_are_clear(reference):
    with pytest.raises(ValueError, match="n=17 samples need 17 batch rows"):
        await reference.generate("x", SamplingParams(n=17))
    with pytest.raises(ValueError, match="a stream carries one sample"):
        reference.stream("x", SamplingParams(n=2))
    with pytest.raises(ValueError, match=r"stop_regex '\(a' is not a valid regex"):
        await reference.generate("x", SamplingParams(stop_regex="(a"))
    assert reference.stats().num_prefills == 0


async def test_a_cache_salt_keeps_requests_of_other_salts_from_each_others_pages(
        engine, reference):
    """vLLM's cache_salt: the same prompt under another salt finds nothing cached (so
    `cached_tokens` tells no one what another tenant asked); under its own it is reused."""
    secret = SYSTEM + "My bank PIN is 7391. "
    await engine.generate(secret + "Remember it.", GREEDY, cache_salt="victim")
    for salt in ("attacker", ""):
        guess = await engine.generate(secret + "Is it?", GREEDY, cache_salt=salt)
        assert guess.cached_tokens == 0
    again = await engine.generate(secret + "Is it?", GREEDY, cache_salt="victim")
    assert again.cached_tokens >= len(secret.encode()) // 16 * 16
    assert again.token_ids == (await reference.generate(secret + "Is it?", GREEDY)).token_ids
    stream = engine.stream(secret + "Tell me.", GREEDY, cache_salt="attacker")
    assert [t async for t in stream] and stream.cached_tokens > 0  # its own earlier guess
