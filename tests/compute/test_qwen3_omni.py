"""Qwen3-Omni on Omni, against transformers (the oracle): a tiny random
`Qwen3OmniMoeForConditionalGeneration` and its processor saved by transformers (see
omni_builders). The thinker's greedy tokens equal `generate(return_audio=False)` for text,
text + image, text + audio and all three, and a second turn reusing the first's KV still
equals transformers recomputing the whole conversation; the talker's speech (greedy) equals
`generate(return_audio=True)`'s codec frames and waveform for the same four prompts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni.compute import SamplingParams, TorchEngine
from omni.compute.models import DecoderConfig, load_pretrained
from omni.compute.models.llama import RotaryEmbedding
from omni.compute.prompt import Audio, Image, Prompt
from omni.compute.talker import Talker, talker_params
from tests.compute.omni_builders import (
    hf_model,
    hf_processor,
    hf_speech,
    hf_thinker_tokens,
    save_omni_checkpoint,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
# the talker greedy (transformers' repetition penalty of 1.05 still applies), 20 codec tokens
# at most and at least 5 (a random talker may stop at once)
TALKER = talker_params(temperature=0, max_new_tokens=20, min_new_tokens=5)
# 40 x 72 px: a grid of 4 x 8 patches, 2 x 4 positions (rows and columns differ, so the
# height and width rotary axes are both exercised)
IMAGE = (np.random.default_rng(0).random((40, 72, 3)) * 255).astype(np.uint8)
AUDIO = (np.random.default_rng(1).standard_normal(16_000) * 0.1).astype(np.float32)  # 1 s


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_omni_checkpoint(tmp_path_factory.mktemp("qwen3_omni"))


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    return hf_model(checkpoint)


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


CASES = {
    "text": [text("What do you hear?")],
    "image": [{"type": "image", "image": IMAGE}, text("Describe the picture.")],
    "audio": [{"type": "audio", "audio": AUDIO}, text("What do you hear?")],
    "image+audio": [{"type": "image", "image": IMAGE}, {"type": "audio", "audio": AUDIO},
                    text("Describe the picture and the sound.")],
}


def media_of(messages: list[dict[str, Any]], kind: str) -> list[Any]:
    return [part[kind] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == kind]


@pytest.mark.parametrize("case", list(CASES))
async def test_thinker_tokens_equal_transformers(checkpoint: Path, hf: Any,
                                                 case: str) -> None:
    """Greedy thinker tokens, and the prompt's ids, equal transformers' processor + generate."""
    engine = TorchEngine.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, user(*CASES[case])]
    processor = hf_processor(checkpoint)
    prompt = engine.chat_prompt(messages)
    rendered = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False)
    inputs = processor(text=[rendered], images=media_of(messages, "image") or None,
                       audio=media_of(messages, "audio") or None, return_tensors="pt")
    ids = prompt if isinstance(prompt, list) else list(engine.prepare(prompt).token_ids)
    assert ids == inputs["input_ids"][0].tolist()
    expected = hf_thinker_tokens(hf, processor, messages, media_of(messages, "image"),
                                 media_of(messages, "audio"), GREEDY.max_new_tokens)
    result = await engine.chat(messages, GREEDY)
    assert result.token_ids == expected and len(expected) == GREEDY.max_new_tokens


async def test_second_turn_reuses_the_first_and_equals_transformers(checkpoint: Path,
                                                                    hf: Any) -> None:
    """Turn 2 (image and audio in turn 1) reads turn 1's pages from the store, media
    included, and still gives transformers' tokens for the whole conversation."""
    engine = TorchEngine.from_pretrained(checkpoint, page_size=4)
    turn1 = [user(*CASES["image+audio"])]
    first = await engine.chat(turn1, GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first.text},
             user(text("And what else?"))]
    second = await engine.chat(turn2, GREEDY)
    assert second.cached_tokens > 0
    processor = hf_processor(checkpoint)
    assert second.token_ids == hf_thinker_tokens(hf, processor, turn2, [IMAGE], [AUDIO],
                                                 GREEDY.max_new_tokens)


async def test_a_different_image_shares_no_page_from_it_on(checkpoint: Path) -> None:
    """The image's digest is in the page keys: another image reuses only the text before."""
    engine = TorchEngine.from_pretrained(checkpoint, page_size=4)
    await engine.chat([user(*CASES["image"])], GREEDY)
    other = [user({"type": "image", "image": 255 - IMAGE}, text("Describe the picture."))]
    result = await engine.chat(other, GREEDY)
    image_start = next(item.start for item in engine.prepare(
        engine.chat_prompt(other)).media)
    assert result.cached_tokens <= image_start


async def test_a_chat_renders_its_conversation_and_digests_its_media_off_the_event_loop(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`chat` passes over every byte of a conversation's media (the content digests) and
    renders its template in a worker thread: the event loop keeps answering meanwhile."""
    import threading

    from omni.compute import prompt
    from omni.kv.keys import media_digest

    engine = TorchEngine.from_pretrained(checkpoint)
    threads = []

    def noting(data: Any) -> bytes:
        threads.append(threading.current_thread())
        return media_digest(data)

    monkeypatch.setattr(prompt, "media_digest", noting)
    await engine.chat([user(*CASES["image+audio"])], GREEDY)
    assert len(threads) == 2 and threading.main_thread() not in threads


def test_mrope_equals_transformers_rotary(checkpoint: Path) -> None:
    """cos / sin at [3, B, T] positions equal the thinker's own rotary embedding."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerTextRotaryEmbedding,
    )

    text_config = Qwen3OmniMoeConfig.from_pretrained(checkpoint).thinker_config.text_config
    _, config = load_pretrained(checkpoint)
    positions = torch.stack([torch.arange(12), torch.arange(12) % 3, torch.arange(12) // 4])
    reference = Qwen3OmniMoeThinkerTextRotaryEmbedding(text_config)
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours = RotaryEmbedding(config)(positions[:, None], torch.float32)
    assert torch.equal(ours[0][:, 0], cos) and torch.equal(ours[1][:, 0], sin)


def test_config_reads_the_thinker_text_decoder(checkpoint: Path) -> None:
    """config.json of a Qwen3-Omni checkpoint -> the thinker's Qwen3-MoE text decoder."""
    _, config = load_pretrained(checkpoint)
    assert config.architecture == "qwen3_moe" and config.mrope_section == (2, 1, 1)
    assert config.num_experts == 8 and config.norm_topk_prob
    with pytest.raises(ValueError, match="mrope_section"):
        DecoderConfig(architecture="qwen3_moe", vocab_size=8, hidden_size=32,
                      intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                      num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                      mrope_section=(4, 4, 4))


def test_media_parts_must_match_the_templates_placeholders(checkpoint: Path) -> None:
    """An image part the template writes no placeholder for is refused, by name."""
    engine = TorchEngine.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGE},
                                              {"type": "image", "image": IMAGE}]}]
    assert isinstance(engine.chat_prompt(messages), Prompt)
    odd = [{"role": "user", "content": "<|image_pad|> typed by hand"}]
    with pytest.raises(ValueError, match="placeholder"):
        engine._with_media(engine.tokenizer.apply_chat_template(odd, tokenize=False),
                           [Audio(AUDIO)])


def test_audio_at_another_rate_is_refused(checkpoint: Path) -> None:
    engine = TorchEngine.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="16000 Hz"):
        engine.prepare(Prompt([Audio(AUDIO, sample_rate=24_000)]))
    assert engine.prepare(Prompt([Image(IMAGE)])).media[0].length == 8


@pytest.mark.parametrize("case", list(CASES))
async def test_speech_equals_transformers_waveform(checkpoint: Path, hf: Any,
                                                   case: str) -> None:
    """Thinker reply, then talker codec frames and code2wav's waveform: the same samples as
    transformers' generate(return_audio=True), greedy, for text, image, audio and both."""
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, user(*CASES[case])]
    reply = await engine.chat(messages, SamplingParams(temperature=0, max_new_tokens=8))
    speech = await talker.speak(engine, engine.chat_prompt(messages), reply.token_ids,
                                sampling=TALKER)
    their_codes: list[Any] = []
    expected_reply, expected_wav = hf_speech(hf, hf_processor(checkpoint), messages,
                                             media_of(messages, "image"),
                                             media_of(messages, "audio"), 8, 20, 5,
                                             codes=their_codes)
    assert reply.token_ids == expected_reply
    assert speech.codes.shape == (4, 19) and speech.sample_rate == 24_000
    assert speech.codes.tolist() == their_codes[0].tolist()  # the talker's codec tokens
    assert speech.waveform.shape == tuple(expected_wav.shape)
    assert np.abs(speech.waveform - expected_wav.numpy()).max() <= 1e-4


async def test_speech_depends_on_the_conversation_and_the_voice(checkpoint: Path) -> None:
    """Another prompt, or another voice, gives other codec frames (the comparison above
    could not pass by a talker that ignores its input); an unknown voice is refused."""
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    sampling = dataclasses.replace(TALKER, max_new_tokens=12)
    codes = []
    for messages, voice in (([user(*CASES["text"])], None), ([user(*CASES["audio"])], None),
                            ([user(*CASES["text"])], "Chelsie")):
        reply = await engine.chat(messages, SamplingParams(temperature=0, max_new_tokens=6))
        speech = await talker.speak(engine, engine.chat_prompt(messages), reply.token_ids,
                                    voice=voice, sampling=sampling)
        codes.append(speech.codes.tolist())
    assert codes[0] != codes[1] and codes[0] != codes[2]
    with pytest.raises(ValueError, match="unknown voice 'Nobody'"):
        await talker.speak(engine, engine.chat_prompt([user(*CASES["text"])]), [5],
                           voice="Nobody")


async def test_speech_streams_before_the_reply_ends(checkpoint: Path, hf: Any) -> None:
    """Speaking while the thinker writes: the first audio chunk comes before the thinker's
    last token, and the chunks together are transformers' waveform."""
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    messages = [user(*CASES["image"])]
    prompt = engine.chat_prompt(messages)
    events: list[str] = []

    async def reply() -> Any:
        stream = engine.stream(prompt, SamplingParams(temperature=0, max_new_tokens=8))
        async for token in stream:
            events.append("token")
            yield token

    chunks = []
    async for chunk in talker.stream(engine, prompt, reply(), sampling=TALKER):
        events.append("audio")
        chunks.append(chunk)
    assert events.count("token") == 8 and len(chunks) > 1
    assert events.index("audio") < len(events) - 1 - events[::-1].index("token")
    _, expected = hf_speech(hf, hf_processor(checkpoint), messages, [IMAGE], [], 8, 20, 5)
    streamed = np.concatenate(chunks)
    assert streamed.shape == tuple(expected.shape)
    assert np.abs(streamed - expected.numpy()).max() <= 1e-4


async def test_sampled_speech_follows_its_seed(checkpoint: Path) -> None:
    """The talker samples as SGLang does (here transformers' defaults: temperature 0.9,
    top-k 50): a seed gives the same frames again, another seed others."""
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    prompt = engine.chat_prompt([user(*CASES["text"])])
    reply = (await engine.generate(prompt, SamplingParams(temperature=0,
                                                          max_new_tokens=6))).token_ids
    codes = []
    for seed in (7, 7, 8):
        sampling = talker_params(max_new_tokens=12, min_new_tokens=10, sampling_seed=seed)
        speech = await talker.speak(engine, prompt, reply, sampling=sampling)
        codes.append(speech.codes.tolist())
        assert speech.codes.shape[1] >= 9 and np.isfinite(speech.waveform).all()
    assert codes[0] == codes[1] and codes[0] != codes[2]


async def test_concurrent_replies_share_talker_steps_and_speak_as_alone(
        checkpoint: Path) -> None:
    """Two replies spoken at once step through one talker batch (continuous batching: a
    reply waiting for its text sits a step out) and each gives the frames it gives alone."""
    import trio

    engine = TorchEngine.from_pretrained(checkpoint)
    prompts = [engine.chat_prompt([user(*CASES[case])]) for case in ("text", "image")]
    replies = [(await engine.generate(p, SamplingParams(temperature=0, max_new_tokens=6)))
               .token_ids for p in prompts]
    alone = []
    for prompt, reply in zip(prompts, replies, strict=True):
        solo = Talker.from_pretrained(checkpoint)
        alone.append((await solo.speak(engine, prompt, reply, sampling=TALKER)).codes)
        assert solo.batch.peak == 1
    talker = Talker.from_pretrained(checkpoint)
    together: list[Any] = [None, None]

    async def speak(i: int) -> None:
        together[i] = (await talker.speak(engine, prompts[i], replies[i], sampling=TALKER)).codes

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(speak, i)
    assert talker.batch.peak == 2 and not talker.batch.runs
    for got, expected in zip(together, alone, strict=True):
        assert got.tolist() == expected.tolist()


async def test_the_talker_reuses_earlier_turns_and_still_speaks_as_transformers(
        checkpoint: Path, hf: Any) -> None:
    """Turn 2's talker prompt starts with turn 1's user turn (media included): its pages
    come from the talker's store, and the speech still equals transformers recomputing the
    whole conversation."""
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    turn1 = [user(*CASES["image+audio"])]
    reply1 = await engine.chat(turn1, greedy)
    await talker.speak(engine, engine.chat_prompt(turn1), reply1.token_ids, sampling=TALKER)
    assert talker.batch.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": reply1.text},
             user(text("And what else?"))]
    reply2 = await engine.chat(turn2, greedy)
    speech = await talker.speak(engine, engine.chat_prompt(turn2), reply2.token_ids,
                                sampling=TALKER)
    assert talker.batch.cached_tokens >= 16
    expected_reply, expected_wav = hf_speech(hf, hf_processor(checkpoint), turn2, [IMAGE],
                                             [AUDIO], 8, 20, 5)
    assert reply2.token_ids == expected_reply
    assert speech.waveform.shape == tuple(expected_wav.shape)
    assert np.abs(speech.waveform - expected_wav.numpy()).max() <= 1e-4


async def test_the_talkers_context_reads_what_the_prefill_kept(checkpoint: Path,
                                                               monkeypatch: Any) -> None:
    """The thinker's hidden states at media positions (what the talker reads) are kept from
    the prefill, equal to computing them again, and found for a later turn whose prefill
    read those positions from the store: the prompt's layers are not run again."""
    from omni.compute.talker import thinker_context

    engine = TorchEngine.from_pretrained(checkpoint)
    turn1 = [user(*CASES["image+audio"])]
    tokens = engine.prepare(engine.chat_prompt(turn1))
    assert engine.runner.media_hidden(tokens) is None  # nothing prefilled yet
    reply = await engine.chat(turn1, GREEDY)
    kept = engine.runner.media_hidden(tokens)
    again = engine.runner.hidden_at(tokens, engine.media.tap_layer)
    for item in tokens.media:
        torch.testing.assert_close(kept[item.start],
                                   again[item.start:item.start + item.length])
    assert engine.runner.media_hidden(tokens, cache_salt="another tenant") is None
    turn2 = [*turn1, {"role": "assistant", "content": reply.text}, user(text("And?"))]
    later = engine.prepare(engine.chat_prompt(turn2))
    second = await engine.chat(turn2, GREEDY)
    assert second.cached_tokens > tokens.media[-1].start + tokens.media[-1].length

    def no_recompute(*args: Any) -> None:
        raise AssertionError("the prompt's layers ran again")

    monkeypatch.setattr(engine.runner, "hidden_at", no_recompute)
    context = thinker_context(engine, later)
    for item in later.media:
        torch.testing.assert_close(context.inputs[item.start:item.start + item.length],
                                   kept[item.start])


async def test_an_abandoned_reply_gives_its_talker_row_back(checkpoint: Path) -> None:
    """A reply closed before its end (a client gone) frees its row and its place in the
    batch's limit: the next reply finds one."""
    from omni.compute.talker import reply_embeddings, thinker_context

    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint, max_batch=1)
    prompt = engine.chat_prompt([user(*CASES["text"])])
    reply = (await engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6))
             ).token_ids
    context = thinker_context(engine, engine.prepare(prompt))
    embeds = reply_embeddings(engine, list(reply))
    abandoned = talker.session(context, sampling=TALKER)
    for i in range(3):
        await abandoned.feed(reply[i], embeds[i])
    assert len(talker.batch.runs) == 1
    abandoned.close()
    speech = await talker.speak(engine, prompt, reply, sampling=TALKER)  # waits for no row
    assert speech.codes.shape[1] > 0 and not talker.batch.runs


def test_a_tower_tensor_missing_is_refused_by_name(tmp_path: Path) -> None:
    """A Qwen3-Omni checkpoint whose vision tower lacks a tensor fails to load, naming it."""
    from safetensors.torch import load_file, save_file

    directory = save_omni_checkpoint(tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["thinker.visual.blocks.0.attn.proj.bias"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"thinker\.visual weights .*blocks\.0\.attn\.proj\.bias"):
        TorchEngine.from_pretrained(directory)


def test_a_processor_saved_nested_by_transformers_5_is_read_as_the_flat_one(
        checkpoint: Path, tmp_path: Path) -> None:
    """transformers 5 saves a processor's parts in one processor_config.json, nested by part;
    the checkpoint loads from it with the same image processor and feature extractor."""
    import json
    import shutil

    from omni.compute.models.qwen3_omni.thinker import Qwen3OmniMedia

    nested = shutil.copytree(checkpoint, tmp_path / "nested")
    flat = json.loads((nested / "preprocessor_config.json").read_text())
    (nested / "preprocessor_config.json").unlink()
    original = Qwen3OmniMedia(checkpoint)
    image, audio = original.image_processor, original.feature_extractor
    parts = {"image_processor": image.to_dict(), "feature_extractor": audio.to_dict(),
             "processor_class": flat["processor_class"]}
    (nested / "processor_config.json").write_text(json.dumps(parts, default=str))
    media = Qwen3OmniMedia(nested)
    assert media.image_processor.to_dict() == image.to_dict()
    assert media.feature_extractor.to_dict() == audio.to_dict()

    del parts["feature_extractor"]
    (nested / "processor_config.json").write_text(json.dumps(parts, default=str))
    with pytest.raises(FileNotFoundError,
                       match=r"no processor_config\.json holding the feature extractor"):
        Qwen3OmniMedia(nested)
