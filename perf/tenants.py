"""omni serve with two tenants: a reply's timing tells no tenant which images another sent.

``omni serve examples/omni_dialogue.py`` on a random Qwen3-Omni checkpoint whose vision tower
is large enough that encoding a request's images is most of its time to first token (the
towers are what a cache keyed by content alone would skip), with two API keys. Each paired
round draws `images` fresh random images (and a clip) three times, X, Y and Z: tenant A sends X
(its encodings and KV now cached under A's salt); then, in an order alternating by round,
tenant B sends X ("another tenant's items") and fresh Y ("fresh items"); then A sends X again
("own items", the cache a tenant keeps). Each is a streamed chat completion of one token,
timed from the request to its first delta, by the official client in this process; the
server runs in its own.

Claim: over `rounds` paired rounds, the median of B's time for A's items over B's time for
fresh ones is within 10% of 1 (0.9 to 1.1): another tenant's items are computed afresh. The
own-items figure shows what the measurement can see: a tenant reusing its own cache answers
in a fraction of the time, so a shared cache would move the claim's ratio by as much.

Usage: ``python perf/tenants.py [--quick] [--out PATH.json] [--plot PATH.png] [--repeats N]``
"""

from __future__ import annotations

import base64
import io
import statistics
import sys
import tempfile
import time
import wave
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import trio

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import (
    Samples,
    benchmark_parser,
    claim,
    environment,
    params_from,
    plot_bars,
    write_json,
)

__all__ = ["Params", "main", "measure"]

ROOT = Path(__file__).resolve().parent.parent
DIALOGUE = ROOT / "examples" / "omni_dialogue.py"
LOW, HIGH = 0.9, 1.1  # B's time for A's items over B's for fresh ones, within
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef0"}


@dataclass(frozen=True)
class Params:
    """The benchmark's sizes."""

    seed: int = 0
    repeats: int = 8  # paired rounds
    images: int = 4  # random images per request (and one clip)
    image_side: int = 224  # pixels
    clip_s: float = 2.0
    vision_depth: int = 8
    vision_hidden: int = 256
    quick: bool = False

    @classmethod
    def small(cls, seed: int = 0) -> Params:
        """Sizes for a smoke run."""
        return cls(seed=seed, repeats=2, images=1, image_side=64, clip_s=0.5, vision_depth=2,
                   vision_hidden=32, quick=True)


def checkpoint(folder: Path, params: Params) -> Path:
    """A random Qwen3-Omni whose vision tower has `vision_depth` blocks of `vision_hidden`,
    taking images of `image_side` square."""
    from tests.compute.omni_builders import save_omni_checkpoint

    vision = {"depth": params.vision_depth, "hidden_size": params.vision_hidden,
              "intermediate_size": 4 * params.vision_hidden, "num_heads": 8,
              "num_position_embeddings": (params.image_side // 8) ** 2,
              "deepstack_visual_indexes": [1, params.vision_depth - 1]}
    return save_omni_checkpoint(folder / "qwen3-omni", params.seed, vision=vision,
                                max_pixels=params.image_side ** 2)


def media(rng: np.random.Generator, params: Params) -> list[dict[str, Any]]:
    """Fresh random images and a clip, as a user message's content parts."""
    from PIL import Image

    parts: list[dict[str, Any]] = []
    for _ in range(params.images):
        pixels = rng.integers(0, 256, (params.image_side, params.image_side, 3), np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, "PNG")
        parts.append({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}})
    samples = (rng.uniform(-0.3, 0.3, int(16_000 * params.clip_s)) * 32767).astype("<i2")
    clip = io.BytesIO()
    with wave.open(clip, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(samples.tobytes())
    parts.append({"type": "input_audio", "input_audio": {
        "data": base64.b64encode(clip.getvalue()).decode(), "format": "wav"}})
    return [*parts, {"type": "text", "text": "What is in these?"}]


async def first_token_s(client: openai.AsyncOpenAI, content: list[dict[str, Any]]) -> float:
    """Seconds from the request to the first delta of a one-token streamed reply."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": content}], max_tokens=1,
        stream=True)
    async for _ in stream:
        break
    elapsed = time.perf_counter() - start
    await stream.close()
    return elapsed


async def rounds(url: str, params: Params) -> dict[str, list[float]]:
    """Each round's times: B on A's items, B on fresh ones, A on its own again."""
    rng = np.random.default_rng(params.seed)
    clients = {name: openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                        timeout=600) for name, key in KEYS.items()}
    times: dict[str, list[float]] = {"others": [], "fresh": [], "own": []}
    await first_token_s(clients["alice"], media(rng, params))  # warm-up: the first request
    for i in range(params.repeats):
        theirs, fresh = media(rng, params), media(rng, params)
        await first_token_s(clients["alice"], theirs)
        order = [("others", theirs), ("fresh", fresh)]
        for kind, content in order if i % 2 == 0 else order[::-1]:
            times[kind].append(await first_token_s(clients["bob"], content))
        times["own"].append(await first_token_s(clients["alice"], theirs))
    for client in clients.values():
        await client.close()
    return times


def measure(params: Params) -> dict[str, Any]:
    """Start the server on a fresh checkpoint, run the rounds, stop it; the claim."""
    from tests.serve._server import running

    with tempfile.TemporaryDirectory(prefix="omni-tenants-") as tmp:
        folder = Path(tmp)
        model = checkpoint(folder, params)
        keys = folder / "keys"
        keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        with running(DIALOGUE, "--api-key-file", str(keys),
                     env={"OMNI_MODEL": str(model)}) as server:
            times = trio.run(rounds, server.url, params)
    ratios = [o / f for o, f in zip(times["others"], times["fresh"], strict=True)]
    own = [o / f for o, f in zip(times["own"], times["fresh"], strict=True)]
    ratio = statistics.median(ratios)
    others, fresh = Samples(tuple(times["others"])), Samples(tuple(times["fresh"]))
    result = claim(
        unit="s", target=HIGH, measured=others, baseline=fresh, ratio=ratio,
        passed=LOW <= ratio <= HIGH, digits=3, low=LOW,
        paired_ratios=[round(r, 3) for r in ratios],
        own_items=Samples(tuple(times["own"])).to_json(3),
        own_ratio=round(statistics.median(own), 3),
        note=(f"{params.repeats} paired rounds on omni serve (Qwen3-Omni, vision tower "
              f"{params.vision_depth} x {params.vision_hidden}, {params.images} images of "
              f"{params.image_side} px and a {params.clip_s:g} s clip a request): time to the "
              "first token of tenant B's request with the images tenant A had just sent "
              "(measured) and with fresh ones (baseline); ratio: the median of the paired "
              "ratios, which must lie within 0.9-1.1. own_ratio: tenant A sending its own "
              "images again, over fresh ones (what a cache shared across tenants would show)"))
    return {"benchmark": "tenants", "env": environment(), "params": asdict(params),
            "claim": result}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run the benchmark, print (and optionally write) the result."""
    parser = benchmark_parser(__doc__, repeats_help="paired rounds",
                              plot_help="write a bar chart (PNG) of the times here",
                              profile_help="(no profile for this benchmark)")
    args = parser.parse_args(argv)
    result = measure(params_from(args, Params))
    write_json(result, args.out)
    if args.plot:
        c = result["claim"]
        plot_bars(args.plot, "omni serve: a tenant's time to first token", [(
            "another tenant's images vs fresh ones", "seconds", {
                "another's": Samples(tuple(c["measured"]["runs"])),
                "fresh": Samples(tuple(c["baseline"]["runs"])),
                "own": Samples(tuple(c["own_items"]["runs"]))})])
    return result


if __name__ == "__main__":
    main()
