"""examples/image_generation.py with ``OMNI_MODEL`` a diffusers folder of each family Omni
serves (Z-Image, Cosmos3): the library's pipeline paints, through ``omni run`` and through
``omni serve`` with the official ``openai`` client, the PNG that diffusers' own pipeline saves
for the same request (Cosmos3's with its safety checker off), pixels within 1."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests._cli import run_omni
from tests.compute.cosmos3_builders import save_cosmos3
from tests.compute.image_builders import save_z_image
from tests.serve._inproc import served

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "image_generation.py"
PROMPT = "A red fox asleep in fresh snow, watercolour."


def z_image_pixels(folder: Path, **request: Any) -> np.ndarray:
    """What diffusers' own ``ZImagePipeline`` paints (its PIL image, as it would save it)."""
    from diffusers import ZImagePipeline

    pipeline = ZImagePipeline.from_pretrained(folder)
    image = pipeline(PROMPT, **request, generator=torch.Generator().manual_seed(3)).images[0]
    return np.asarray(image)


def cosmos3_pixels(folder: Path, **request: Any) -> np.ndarray:
    """What diffusers' own ``Cosmos3OmniPipeline`` paints (one frame, as its PIL image would
    be saved)."""
    from diffusers import Cosmos3OmniPipeline

    pipeline = Cosmos3OmniPipeline.from_pretrained(folder, safety_checker=None,
                                                   enable_safety_checker=False)
    frame = pipeline(PROMPT, num_frames=1, output_type="np",
                     generator=torch.Generator().manual_seed(3), **request).video[0]
    return (frame * 255).round().astype(np.uint8)


# each family: a tiny random folder of it, and its oracle
FAMILIES: dict[str, tuple[Callable[[Path], Path], Callable[..., np.ndarray]]] = {
    "z_image": (save_z_image, z_image_pixels), "cosmos3": (save_cosmos3, cosmos3_pixels)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, Callable[..., np.ndarray]]:
    """A family's folder and its oracle."""
    save, oracle = FAMILIES[request.param]
    return save(tmp_path_factory.mktemp(f"{request.param}_folder")), oracle


def within_one(ours: np.ndarray, theirs: np.ndarray) -> bool:
    return bool(np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1)


def test_omni_run_writes_the_png_diffusers_paints(
        family: tuple[Path, Callable[..., np.ndarray]], tmp_path: Path) -> None:
    folder, oracle = family
    out = tmp_path / "fox.png"
    done = run_omni("run", str(EXAMPLE), f"--input=prompt={PROMPT}", f"--input=out={out}",
                    "--input=width=32", "--input=height=24", "--input=steps=3",
                    "--input=guidance=4.0", "--input=negative_prompt=blurry",
                    "--input=seed=3", "--json", env={"OMNI_MODEL": str(folder)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["output"]
    assert (report["out"], report["width"], report["height"]) == (str(out), 32, 24)
    assert report["usage"]["input_tokens"] > 0
    theirs = oracle(folder, width=32, height=24, num_inference_steps=3, guidance_scale=4.0,
                    negative_prompt="blurry")
    assert within_one(np.asarray(Image.open(out)), theirs)


@pytest.mark.parametrize("guidance", [0.0, 1.0])
async def test_the_openai_client_gets_the_png_diffusers_paints(
        family: tuple[Path, Callable[..., np.ndarray]], monkeypatch: pytest.MonkeyPatch,
        guidance: float) -> None:
    folder, oracle = family
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    async with served(EXAMPLE) as app, app.openai() as client:
        reply = await client.images.generate(
            prompt=PROMPT, size="48x32", response_format="b64_json", extra_body={
                "seed": 3, "num_inference_steps": 2, "guidance_scale": guidance})
    ours = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))))
    theirs = oracle(folder, width=48, height=32, num_inference_steps=2,
                    guidance_scale=guidance)
    assert ours.shape == (32, 48, 3) and within_one(ours, theirs)
    assert reply.usage is not None and reply.usage.input_tokens > 0
