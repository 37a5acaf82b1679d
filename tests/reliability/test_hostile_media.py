"""A hostile client's media against ``examples/omni_dialogue.py`` served as ``omni serve``:

- twenty 4,096 x 4,096 1-bit PNGs (each at the per-image cap, 2.8 KiB of base64; 1 GB once
  decoded), to a real server process: refused from their headers by the request's pixel
  budget, the server's memory barely moving, ``/health`` answering meanwhile;
- clips too short for the audio encoder, cut mid-sample, without a format, and a lone
  surrogate in a text: each a 400 naming the field in the request's own terms;
- a remote image URL that points at the server's own machine: refused, the machine's
  server never asked.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from PIL import Image

from omni.serve import MediaPolicy
from tests.reliability.test_hostile_serve import MIB
from tests.serve._inproc import served
from tests.serve._server import ROOT, running

DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
TIMEOUT_S = 120.0  # a client's cap; reached only by a broken run


def png_bomb() -> str:
    """A 4,096 x 4,096 1-bit PNG (16,777,216 pixels: the per-image cap) as a data URL."""
    out = io.BytesIO()
    Image.new("1", (4096, 4096)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def memory(pid: int) -> dict[str, int]:
    """A process's resident memory now (VmRSS) and at its peak (VmHWM), in bytes."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines
            if line.startswith(("VmRSS:", "VmHWM:"))}


@pytest.mark.proc  # the server's own memory, measured from outside
async def test_twenty_images_at_the_cap_are_refused_by_the_budget_while_health_answers(
        record) -> None:
    bomb = png_bomb()
    content = [{"type": "image_url", "image_url": {"url": bomb}}] * 20
    body = {"model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    with running(DIALOGUE) as server:
        pid = server.process.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts over from now
        before = memory(pid)
        health: list[int] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as http:
            answer = await _while_polling(http, body, health)
        after = memory(pid)
    grew = after["VmHWM"] - before["VmRSS"]
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "335,544,320 pixels" in error["message"] and "--max-request-pixels" in (
        error["message"]) and error["param"] == "messages"
    assert health and set(health) == {200}
    assert grew < 100 * MIB, f"the server's peak RSS grew {grew / MIB:.0f} MiB"  # was +1 GB
    record("serve.media_budget", tries=1 + len(health),
           outcome=f"a {len(str(body)) // 1024} KiB request of 20 PNGs of 4,096 x 4,096 "
                   f"pixels refused (400, the request's pixel budget) from their headers; the "
                   f"server's peak RSS +{grew // MIB} MiB; /health answered {len(health)} "
                   "times meanwhile, all 200")


async def _while_polling(http: httpx.AsyncClient, body: dict, health: list[int]
                         ) -> httpx.Response:
    """The answer to `body`, /health polled (its statuses in `health`) until it came."""
    answer: list[httpx.Response] = []

    async def poll() -> None:
        while not answer or not health:
            health.append((await http.get("/health")).status_code)
            await trio.sleep(0.02)  # a load balancer's polling, not a wait

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        answer.append(await http.post("/v1/chat/completions", json=body))
    return answer[0]


def wav_base64(num_samples: int, cut: int = 0) -> str:
    """A 16 kHz mono 16-bit WAV of `num_samples` samples, its last `cut` bytes cut off."""
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16_000)
        clip.writeframes(np.full(num_samples, 1000, "<i2").tobytes())
    raw = out.getvalue()
    return base64.b64encode(raw[:len(raw) - cut]).decode()


def clip(data: str, **extra: str) -> list[dict]:
    return [{"type": "text", "text": "Hear this:"},
            {"type": "input_audio", "input_audio": {"data": data, **extra}}]


WHERE = "messages.0.content.1.input_audio"
CLIPS = [  # (content, the param named, what the message says)
    *[(clip(wav_base64(n), format="wav"), f"{WHERE}.data",
       f"the clip has {n} samples; at least 201 are needed") for n in (1, 120, 159, 160, 200)],
    (clip(wav_base64(400, cut=1), format="wav"), f"{WHERE}.data", "the clip is cut short"),
    (clip(wav_base64(400)), f"{WHERE}.format", "Field required"),
    (clip(base64.b64encode(b"RIFF").decode(), format="wav"), f"{WHERE}.data",
     "is not a PCM WAV file: it ends before its header does"),
]


async def test_malformed_clips_and_texts_get_a_400_naming_the_field(record) -> None:
    async with served(DIALOGUE) as app, app.http() as http:
        answers = [await http.post("/v1/chat/completions", json={
            "model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": c}]})
            for c, _, _ in CLIPS]
        surrogate = await http.post("/v1/chat/completions", headers={
            "content-type": "application/json"}, content=b'{"model": "chat", "messages": '
            b'[{"role": "user", "content": "hi \\ud800"}]}')
        fine = await http.post("/v1/chat/completions", json={
            "model": "chat", "max_tokens": 1,
            "messages": [{"role": "user", "content": clip(wav_base64(201), format="wav")}]})
    for answer, (_, param, says) in zip(answers, CLIPS, strict=True):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and says in error["message"], error
        assert error["message"].startswith(param)
    assert surrogate.status_code == 400
    assert "lone UTF-16 surrogate" in surrogate.json()["error"]["message"]
    assert "truncated" not in surrogate.json()["error"]["message"]
    assert fine.status_code == 200, fine.text  # the shortest clip the encoders take
    record("serve.malformed_media", tries=len(answers) + 2,
           outcome=f"{len(answers)} clips (1 to 200 samples, cut mid-sample, no format, a "
                   "header cut short) and "
                   "a lone surrogate each refused with a 400 naming the field; a 201-sample "
                   "clip answered")


async def test_remote_media_cannot_reach_the_servers_own_machine(record) -> None:
    hits: list[str] = []
    with _local_server(hits) as port:
        urls = [f"http://127.0.0.1:{port}/cat.png", f"http://localhost:{port}/cat.png",
                f"http://[::ffff:127.0.0.1]:{port}/cat.png", f"http://0.0.0.0:{port}/cat.png",
                "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/cat.png"]
        async with served(DIALOGUE, media=MediaPolicy(allow_remote=True)) as app, \
                app.http() as http:
            answers = [await http.post("/v1/chat/completions", json={
                "model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}]}]}) for url in urls]
    for url, answer in zip(urls, answers, strict=True):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == (
            f"messages.0.content.0.image_url.url: cannot fetch {url}")
    assert hits == []  # the machine's own server was never asked
    record("serve.remote_media_ssrf", tries=len(urls),
           outcome=f"{len(urls)} image URLs at loopback, private and link-local addresses "
                   "(the server's machine among them) refused with 'cannot fetch' alone; the "
                   "local server received no request")


@contextlib.contextmanager
def _local_server(hits: list[str]) -> Iterator[int]:
    """An HTTP server on 127.0.0.1 that notes every path asked of it; its port."""

    class Noting(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            """Silent: the test reads `hits`, not the server's log on stderr."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Noting)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
