"""What a Qwen3-Omni request caches beyond the thinker's KV pages (its media encodings, the
talker's prompt pages) is reused under its own cache salt only: a request of another salt (another
tenant) recomputes it, so no reply's timing tells a tenant what another sent. A tiny random
checkpoint (see omni_builders); reuse is read from counters, never from time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni.compute import SamplingParams, TorchEngine
from omni.compute.talker import Talker, reply_embeddings, talker_params, thinker_context
from tests.compute.omni_builders import save_omni_checkpoint

SHORT = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
TALKER = talker_params(temperature=0, max_new_tokens=6, min_new_tokens=2)
IMAGE = (np.random.default_rng(0).random((40, 72, 3)) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_omni_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tenants"))


def asking(question: str) -> list[dict[str, Any]]:
    """A conversation whose text before the image differs with `question` (so no KV page
    holds the image for another question) and whose image is always `IMAGE`."""
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "image", "image": IMAGE}]}]


async def test_an_image_is_encoded_again_for_another_salt_only(checkpoint: Path) -> None:
    engine = TorchEngine.from_pretrained(checkpoint)
    tower_runs = []
    engine.media.visual.register_forward_hook(lambda *args: tower_runs.append(1))

    async def ask(question: str, salt: str) -> None:
        await engine.generate(engine.chat_prompt(asking(question)), SHORT, cache_salt=salt)

    await ask("What is it?", "tenant-a")
    assert len(tower_runs) == 1
    await ask("And what colour is it, in a word?", "tenant-a")  # the same tenant: reused
    assert len(tower_runs) == 1
    await ask("And what colour is it, in a word?", "tenant-b")  # another: encoded again
    assert len(tower_runs) == 2
    stats = engine.runner.encoded.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 2)


async def speak(engine: TorchEngine, talker: Talker, question: str, salt: str) -> int:
    """Speak the thinker's reply to `question` under `salt`; the talker's prompt tokens that
    came from its store."""
    prompt = engine.chat_prompt(asking(question))
    reply = list((await engine.generate(prompt, SHORT, cache_salt=salt)).token_ids)
    context = thinker_context(engine, engine.prepare(prompt), salt)
    before = talker.batch.cached_tokens
    session = talker.session(context, sampling=TALKER)
    for token, embed in zip(reply, reply_embeddings(engine, reply), strict=True):
        await session.feed(token, embed)
    await session.finish()
    return talker.batch.cached_tokens - before


async def test_the_talkers_pages_are_reused_under_the_same_salt_only(checkpoint: Path) -> None:
    engine = TorchEngine.from_pretrained(checkpoint)
    talker = Talker.from_pretrained(checkpoint)
    assert await speak(engine, talker, "What is it?", "tenant-a") == 0
    assert await speak(engine, talker, "What is it?", "tenant-a") >= 16  # its own pages
    assert await speak(engine, talker, "What is it?", "tenant-b") == 0  # not tenant a's
    assert await speak(engine, talker, "What is it?", "tenant-b") >= 16
