"""A hostile client against ``examples/omni_dialogue.py`` served as ``omni serve`` serves it
(two API keys, one allowed folder), in process over httpx's ASGI transport, with raw httpx
and the official ``openai`` client:

- it names server paths: writes are refused and leave the file as it was, reads are refused
  with one message whatever the path;
- it sends a 560 KB PNG of 12,000 x 12,000 pixels and a 30 MB message: both refused (400)
  before the work, while ``/health`` keeps answering, the peak memory barely moving;
- it probes another tenant's prompt through ``cached_tokens``: the right guess and the wrong
  ones read the same.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio
from PIL import Image

from cli.serve import _read_keys
from omni.serve import FilePolicy, GuardState
from tests.serve._inproc import Served, served
from tests.serve._server import ROOT

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
KEYS = "victim key-of-the-victim\nattacker key-of-the-attacker\n"
MIB = 1 << 20


@asynccontextmanager
async def server(folder: Path) -> AsyncIterator[Served]:
    """The dialogue served with ``--api-key-file`` (its two keys) and ``--allow-path``
    (`folder`/allowed); `folder` also holds a secret no client may read."""
    (folder / "keys").write_text(KEYS)
    (folder / "keys").chmod(0o600)
    allowed, outputs = folder / "allowed", folder / "outputs"
    allowed.mkdir()
    outputs.mkdir()
    (folder / "secret.txt").write_text("not for clients")
    state = GuardState(api_keys=_read_keys(str(folder / "keys")))
    async with served(DIALOGUE, state=state,
                      files=FilePolicy.create([str(allowed)], str(outputs))) as app:
        yield app


async def post(http: httpx.AsyncClient, body: dict) -> httpx.Response:
    return await http.post("/v1/graphs/dialogue", json=body)


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), in bytes."""
    status = Path("/proc/self/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> int:
    """Start the peak over from the memory resident now (Linux: clear_refs 5); that peak."""
    Path("/proc/self/clear_refs").write_text("5")
    return peak_rss()


async def test_a_client_naming_server_paths_writes_nothing_and_reads_nothing(tmp_path,
                                                                             record):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    async with server(tmp_path) as app, app.http(
            authorization="Bearer key-of-the-attacker") as http:
        writes = [await post(http, {"inputs": {"session": "s", "text": "x", "out": out,
                                               "max_tokens": 1}})
                  for out in (str(victim), str(tmp_path / "new" / "a" / "b" / "c.wav"),
                              "../victim.txt")]
        assert [w.status_code for w in writes] == [400] * 3
        assert victim.read_text() == "precious" and not (tmp_path / "new").exists()
        reads = [await post(http, {"inputs": {"session": "s", "text": "x", field: path}})
                 for field in ("image", "audio")
                 for path in ("/etc/shadow", "/no/such/file", str(tmp_path / "secret.txt"),
                              "../secret.txt", "/proc/self/environ")]
        assert {r.status_code for r in reads} == {400}
        messages = {r.json()["error"]["message"].replace("'audio'", "'image'") for r in reads}
        assert len(messages) == 1, messages  # nothing tells whether a path exists
        inside = tmp_path / "allowed" / "pixels.png"
        Image.new("RGB", (24, 24), (200, 10, 10)).save(inside)
        allowed = await post(http, {"inputs": {"session": "s", "text": "x",
                                               "image": "pixels.png", "max_tokens": 1}})
        assert allowed.status_code == 200, allowed.text
    record("serve.client_paths", tries=len(writes) + len(reads) + 1,
           outcome=f"{len(writes)} writes through `out` refused (400; the file unchanged, no "
                   f"folder made), {len(reads)} reads through `image`/`audio` refused with one "
                   "message whatever the path; a file under --allow-path read")


# Pillow warns as it reads the bomb's header (the server then refuses it, as asserted). The
# server silences that warning where its module is imported: in this process, inside whichever
# test's warning capture that happened, which pytest undoes as that test ends.
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
async def test_a_decompression_bomb_and_a_huge_prompt_are_refused_while_health_answers(
        tmp_path, record):
    picture = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(picture, "PNG")
    bomb = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    huge = "tell me more " * (30 * MIB // 13)
    async with server(tmp_path) as app:
        before = reset_peak_rss()
        outcome = await _hostile_while_polling_health(app, bomb, huge)
        grew = peak_rss() - before  # the client's copies of the message included
    assert outcome["bomb"][0] == 400 and "12000 x 12000" in outcome["bomb"][1]
    assert outcome["huge"][0] == 400 and "this model's context is" in outcome["huge"][1]
    assert outcome["health"] and set(outcome["health"]) == {200}
    assert grew < 600 * MIB, f"peak RSS grew {grew / MIB:.0f} MiB"  # was 3.8 GB for the PNG
    record("serve.bounded_work", tries=2 + len(outcome["health"]),
           outcome=f"a {len(picture.getvalue()) // 1024} KB PNG of 12,000 x 12,000 pixels "
                   f"refused (400) in {outcome['bomb'][2]:.2f} s, a {len(huge) // MIB} MiB "
                   f"message refused before tokenizing in {outcome['huge'][2]:.2f} s; "
                   f"/health answered {len(outcome['health'])} times meanwhile (slowest "
                   f"{outcome['slowest_health'] * 1e3:.0f} ms); peak RSS +{grew // MIB} MiB")


async def _hostile_while_polling_health(app: Served, bomb: str, huge: str) -> dict:
    outcome: dict = {"health": [], "slowest_health": 0.0}
    done = trio.Event()

    async def send(name: str, content) -> None:
        start = time.perf_counter()
        try:
            async with app.openai("key-of-the-attacker") as client:
                await client.chat.completions.create(
                    model="chat", max_tokens=1, messages=[{"role": "user", "content": content}])
            outcome[name] = (200, "", time.perf_counter() - start)
        except openai.APIStatusError as exc:
            outcome[name] = (exc.status_code, exc.message, time.perf_counter() - start)

    async def poll_health() -> None:
        async with app.http() as http:
            while not done.is_set() or not outcome["health"]:
                start = time.perf_counter()
                answer = await http.get("/health")
                outcome["slowest_health"] = max(outcome["slowest_health"],
                                                time.perf_counter() - start)
                outcome["health"].append(answer.status_code)
                await trio.sleep(0.02)  # a load balancer's polling, not a wait

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_health)
        async with trio.open_nursery() as senders:
            senders.start_soon(send, "bomb", [{"type": "image_url",
                                               "image_url": {"url": bomb}}])
            senders.start_soon(send, "huge", huge)
        done.set()
    return outcome


async def test_another_tenants_prompt_cannot_be_guessed_from_cached_tokens(tmp_path, record):
    secret = ("You are the bank's assistant. The customer's card is 4111 1111 1111 1111 and "
              "the PIN is 7391. ")
    async with server(tmp_path) as app, app.openai("key-of-the-victim") as victim, \
            app.openai("key-of-the-attacker") as attacker:

        async def cached(client: openai.AsyncOpenAI, text: str, **extra) -> int:
            reply = await client.chat.completions.create(
                model="chat", max_tokens=1, extra_body=extra or None,
                messages=[{"role": "user", "content": text}])
            return reply.usage.prompt_tokens_details.cached_tokens

        await cached(victim, secret + "What is my balance?")
        # each guess under a salt of its own, so that none reuses the attacker's earlier
        # ones: whatever it finds cached could only be the victim's
        guesses = {pin: await cached(attacker, secret.replace("7391", pin) + "Hi",
                                     cache_salt=f"guess-{pin}")
                   for pin in ("7391", "7390", "1234")}
        assert set(guesses.values()) == {0}, guesses  # the right guess reads like the wrong
        own = await cached(victim, secret + "And my card?")
        assert own >= 96  # the victim still reuses her own prefix
        salted = await cached(victim, secret + "And my card?", cache_salt="another")
        assert salted == 0
    record("serve.tenant_probe", tries=len(guesses) + 2,
           outcome=f"the attacker's {len(guesses)} guesses of the victim's PIN all read "
                   f"cached_tokens 0 (right and wrong alike); the victim reused {own} tokens "
                   "of her own, 0 under another cache_salt")
