"""A hostile client against a real ``omni serve examples/omni_dialogue.py`` (two API keys,
one allowed folder), with raw httpx and the official ``openai`` client:

- it names server paths: writes are refused and leave the file as it was, reads are refused
  with one message whatever the path;
- it sends a 560 KB PNG of 12,000 x 12,000 pixels and a 30 MB message: both refused (400)
  before the work, while ``/health`` keeps answering, the server's peak memory barely moving;
- it probes another tenant's prompt through ``cached_tokens``: the right guess and the wrong
  ones read the same.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio
from PIL import Image

from tests.serve._server import ROOT, running

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
KEYS = "victim key-of-the-victim\nattacker key-of-the-attacker\n"
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("hostile-serve")
    (folder / "keys").write_text(KEYS)
    (folder / "keys").chmod(0o600)
    allowed = folder / "allowed"
    allowed.mkdir()
    (folder / "secret.txt").write_text("not for clients")
    with running(DIALOGUE, "--api-key-file", str(folder / "keys"), "--allow-path",
                 str(allowed)) as server:
        server.folder = folder
        yield server


def post(server, body: dict, key: str = "key-of-the-attacker") -> httpx.Response:
    return httpx.post(server.url + "/v1/graphs/dialogue", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def peak_rss(server) -> int:
    """The server process's peak resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_client_naming_server_paths_writes_nothing_and_reads_nothing(server, record):
    victim = server.folder / "victim.txt"
    victim.write_text("precious")
    writes = [post(server, {"inputs": {"session": "s", "text": "x", "out": out,
                                       "max_tokens": 1}})
              for out in (str(victim), str(server.folder / "new" / "a" / "b" / "c.wav"),
                          "../victim.txt")]
    assert [w.status_code for w in writes] == [400] * 3
    assert victim.read_text() == "precious" and not (server.folder / "new").exists()
    reads = [post(server, {"inputs": {"session": "s", "text": "x", field: path}})
             for field in ("image", "audio")
             for path in ("/etc/shadow", "/no/such/file", str(server.folder / "secret.txt"),
                          "../secret.txt", "/proc/self/environ")]
    assert {r.status_code for r in reads} == {400}
    messages = {r.json()["error"]["message"].replace("'audio'", "'image'") for r in reads}
    assert len(messages) == 1, messages  # nothing tells whether a path exists
    inside = server.folder / "allowed" / "pixels.png"
    Image.new("RGB", (24, 24), (200, 10, 10)).save(inside)
    allowed = post(server, {"inputs": {"session": "s", "text": "x", "image": "pixels.png",
                                       "max_tokens": 1}})
    assert allowed.status_code == 200, allowed.text
    record("serve.client_paths", tries=len(writes) + len(reads) + 1,
           outcome=f"{len(writes)} writes through `out` refused (400; the file unchanged, no "
                   f"folder made), {len(reads)} reads through `image`/`audio` refused with one "
                   "message whatever the path; a file under --allow-path read")


def test_a_decompression_bomb_and_a_huge_prompt_are_refused_while_health_answers(
        server, record):
    picture = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(picture, "PNG")
    bomb = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    huge = "tell me more " * (30 * MIB // 13)
    before = peak_rss(server)
    outcome = trio.run(_hostile_while_polling_health, server, bomb, huge)
    grew = peak_rss(server) - before
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


async def _hostile_while_polling_health(server, bomb: str, huge: str) -> dict:
    outcome: dict = {"health": [], "slowest_health": 0.0}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="key-of-the-attacker",
                                max_retries=0, timeout=120)
    done = trio.Event()

    async def send(name: str, content) -> None:
        start = time.perf_counter()
        try:
            await client.chat.completions.create(
                model="chat", max_tokens=1, messages=[{"role": "user", "content": content}])
            outcome[name] = (200, "", time.perf_counter() - start)
        except openai.APIStatusError as exc:
            outcome[name] = (exc.status_code, exc.message, time.perf_counter() - start)

    async def poll_health() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            while not done.is_set() or not outcome["health"]:
                start = time.perf_counter()
                answer = await http.get("/health")
                outcome["slowest_health"] = max(outcome["slowest_health"],
                                                time.perf_counter() - start)
                outcome["health"].append(answer.status_code)
                await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_health)
        async with trio.open_nursery() as senders:
            senders.start_soon(send, "bomb", [{"type": "image_url",
                                               "image_url": {"url": bomb}}])
            senders.start_soon(send, "huge", huge)
        done.set()
    await client.close()
    return outcome


def test_another_tenants_prompt_cannot_be_guessed_from_cached_tokens(server, record):
    secret = ("You are the bank's assistant. The customer's card is 4111 1111 1111 1111 and "
              "the PIN is 7391. ")

    def cached(key: str, text: str, **extra) -> int:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                               timeout=120)
        reply = client.chat.completions.create(
            model="chat", max_tokens=1, extra_body=extra or None,
            messages=[{"role": "user", "content": text}])
        return reply.usage.prompt_tokens_details.cached_tokens

    cached("key-of-the-victim", secret + "What is my balance?")
    # each guess under a salt of its own, so that none reuses the attacker's earlier ones:
    # whatever it finds cached could only be the victim's
    guesses = {pin: cached("key-of-the-attacker", secret.replace("7391", pin) + "Hi",
                           cache_salt=f"guess-{pin}") for pin in ("7391", "7390", "1234")}
    assert set(guesses.values()) == {0}, guesses  # the right guess reads like the wrong
    own = cached("key-of-the-victim", secret + "And my card?")
    assert own >= 96  # the victim still reuses her own prefix
    salted = cached("key-of-the-victim", secret + "And my card?", cache_salt="another")
    assert salted == 0
    record("serve.tenant_probe", tries=len(guesses) + 2,
           outcome=f"the attacker's {len(guesses)} guesses of the victim's PIN all read "
                   f"cached_tokens 0 (right and wrong alike); the victim reused {own} tokens "
                   "of her own, 0 under another cache_salt")
