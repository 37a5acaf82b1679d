"""A hostile tenant against ``examples/omni_dialogue.py`` served as ``omni serve`` serves it
(two API keys read from a key file, an operator's key for /metrics), in process over httpx's
ASGI transport:

- it opens more dialogue sessions than a tenant may keep, to evict another tenant's
  conversation: only its own oldest session goes, the other's goes on where it was;
- it reads /metrics, whose KV page counts tell another tenant's prompt length: refused (403),
  while the operator's key reads them;
- served a Qwen3-Omni checkpoint (a tiny random one), it sends the image another tenant just
  sent, and asks for speech: its image is encoded again and its talker reads none of the
  other's pages (a hit would answer faster: a timing side channel), while the other tenant,
  asking again, reuses its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import trio

from cli.serve import _read_keys
from omni.compute.models.qwen3_omni import Qwen3OmniMedia
from omni.compute.talker import TalkerBatch
from omni.serve import GuardState
from tests.compute.omni_builders import save_omni_checkpoint
from tests.serve._inproc import Served, served
from tests.serve._media import png_data_url
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
VICTIM, ATTACKER, OPERATOR = ("key-of-the-victim-0001", "key-of-the-attacker-02",
                              "key-of-the-operator-3")


@asynccontextmanager
async def server(folder: Path) -> AsyncIterator[Served]:
    """The dialogue served with ``--api-key-file`` (two tenants) and ``--metrics-key-file``."""
    (folder / "keys").write_text(f"victim {VICTIM}\nattacker:{ATTACKER}\n")
    (folder / "operator").write_text(f"# the operator's\n{OPERATOR}\n")
    state = GuardState(api_keys=_read_keys(str(folder / "keys")),
                       metrics_keys=frozenset(_read_keys(str(folder / "operator"))))
    async with served(DIALOGUE, state=state) as app:
        yield app


async def turn(http: httpx.AsyncClient, key: str, session: str, text: str) -> dict:
    answer = await http.post("/v1/graphs/dialogue", headers={"authorization": f"Bearer {key}"},
                             json={"inputs": {"session": session, "text": text,
                                              "max_tokens": 1}})
    assert answer.status_code == 200, answer.text
    return answer.json()["output"]


async def test_a_tenant_flooding_sessions_evicts_only_its_own(tmp_path, record):
    async with server(tmp_path) as app, app.http() as http:
        quota = app.graphs["dialogue"].fn.__globals__["MAX_SESSIONS"]
        await turn(http, VICTIM, "mine", "My name is Ada and my PIN is 7391.")
        await turn(http, ATTACKER, "flood-0", "hello")
        limiter = trio.CapacityLimiter(8)

        async def flood(i: int) -> None:
            async with limiter:
                await turn(http, ATTACKER, f"flood-{i}", "hello")

        async with trio.open_nursery() as nursery:
            for i in range(1, quota + 1):
                nursery.start_soon(flood, i)
        victims = await turn(http, VICTIM, "mine", "What is my PIN?")
        attackers = await turn(http, ATTACKER, "flood-0", "hello again")
    assert victims["turn"] == 2 and victims["cached_tokens"] > 0  # turn 1 still there
    assert attackers["turn"] == 1  # the attacker's oldest session was the one evicted
    record("serve.tenant_sessions", tries=quota + 3,
           outcome=f"a tenant opened {quota + 1} dialogue sessions (its quota: {quota}): its "
                   "own oldest started over; the other tenant's conversation went on at turn "
                   f"2 with {victims['cached_tokens']} cached prompt tokens")


async def test_metrics_are_the_operators_not_a_tenants(tmp_path, record):
    async with server(tmp_path) as app, app.http() as http:
        await turn(http, VICTIM, "mine", "My name is Ada and my PIN is 7391.")

        async def scrape(key: str | None) -> int:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return (await http.get("/metrics", headers=headers)).status_code

        statuses = [await scrape(key) for key in (ATTACKER, VICTIM, None, "nope", OPERATOR)]
        operator_text = (await http.get("/metrics", headers={
            "authorization": f"Bearer {OPERATOR}"})).text
        refused = await http.post("/v1/graphs/dialogue", headers={
            "authorization": f"Bearer {OPERATOR}"}, json={"inputs": {"session": "s",
                                                                      "text": "x"}})
    assert statuses == [403, 403, 401, 401, 200]
    assert "omni_" in operator_text
    assert refused.status_code == 401  # the operator's key is no tenant's
    record("serve.tenant_metrics", tries=len(statuses) + 1,
           outcome="/metrics refused to both tenants' keys (403) and without a key (401), "
                   "read with the operator's (--metrics-key-file); the operator's key "
                   "refused on /v1/ routes (401)")


async def test_another_tenants_image_and_speech_are_computed_again(tmp_path, monkeypatch,
                                                                   record):
    monkeypatch.setenv("OMNI_MODEL", str(save_omni_checkpoint(tmp_path / "qwen3-omni")))
    image = (np.random.default_rng(0).random((40, 72, 3)) * 255).astype(np.uint8)
    towers, talker_reads, talker_stores = [], [], set()
    encode_image, add = Qwen3OmniMedia._encode_image, TalkerBatch.add

    def counted_encode(media, segment):
        towers.append(1)
        return encode_image(media, segment)

    def counted_add(batch, run):
        before = batch.cached_tokens
        add(batch, run)
        talker_reads.append(batch.cached_tokens - before)
        talker_stores.add(batch.store)

    monkeypatch.setattr(Qwen3OmniMedia, "_encode_image", counted_encode)
    monkeypatch.setattr(TalkerBatch, "add", counted_add)
    request = {"model": "chat", "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                   {"type": "text", "text": "What is in the picture?"}]}],
               "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"},
               "extra_body": {"stages": {"talker": {"temperature": 0, "max_new_tokens": 4}}}}
    try:
        async with server(tmp_path) as app:
            for key in (VICTIM, VICTIM, ATTACKER):
                async with app.openai(key) as client:
                    await client.chat.completions.create(**request)
    finally:
        # the dialogue's talker keeps a store of its own, which nothing closes as the
        # runtime stops (its shared memory stays until the process exits)
        for store in talker_stores:
            store.close()
    assert len(towers) == 2  # the victim's once, the attacker's again
    assert talker_reads[0] == 0 and talker_reads[1] >= 16  # the victim reuses its own
    assert talker_reads[2] == 0  # none of the victim's
    record("serve.tenant_media", tries=3,
           outcome="another tenant's image encoded again (the vision tower ran 2 times for 3 "
                   f"requests), its talker read 0 of the {talker_reads[1]} prompt tokens the "
                   "first tenant's talker found on its own second request")
