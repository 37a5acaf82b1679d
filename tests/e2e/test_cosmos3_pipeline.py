"""examples/image_generation.py with ``OMNI_MODEL`` a Cosmos3 folder (diffusers' layout): the
library's pipeline (`omni.pipelines.cosmos3_graph`) paints, through ``omni run`` and through
``omni serve`` with the official ``openai`` client, the PNG diffusers' own
``Cosmos3OmniPipeline`` saves for the same request (its safety checker off)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests._cli import run_omni
from tests.compute.cosmos3_builders import save_cosmos3
from tests.serve._inproc import served

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "image_generation.py"
PROMPT = "A red fox asleep in fresh snow, watercolour."


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cosmos3(tmp_path_factory.mktemp("cosmos3_folder"))


def diffusers_pixels(folder: Path, **request: Any) -> np.ndarray:
    """What diffusers' own pipeline paints (one frame, as its PIL image would be saved)."""
    from diffusers import Cosmos3OmniPipeline

    pipeline = Cosmos3OmniPipeline.from_pretrained(folder, safety_checker=None,
                                                   enable_safety_checker=False)
    frame = pipeline(PROMPT, num_frames=1, output_type="np",
                     generator=torch.Generator().manual_seed(3), **request).video[0]
    return (frame * 255).round().astype(np.uint8)


def test_omni_run_writes_the_png_diffusers_paints(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    done = run_omni("run", str(EXAMPLE), f"--input=prompt={PROMPT}", f"--input=out={out}",
                    "--input=width=32", "--input=height=24", "--input=steps=3",
                    "--input=guidance=4.0", "--input=negative_prompt=blurry",
                    "--input=seed=3", "--json", env={"OMNI_MODEL": str(folder)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)["output"]
    assert (report["out"], report["width"], report["height"]) == (str(out), 32, 24)
    assert report["usage"]["input_tokens"] > 0
    theirs = diffusers_pixels(folder, width=32, height=24, num_inference_steps=3,
                              guidance_scale=4.0, negative_prompt="blurry")
    ours = np.asarray(Image.open(out))
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


async def test_the_openai_client_gets_the_png_diffusers_paints(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    async with served(EXAMPLE) as app, app.openai() as client:
        reply = await client.images.generate(
            prompt=PROMPT, size="32x32", response_format="b64_json", extra_body={
                "seed": 3, "num_inference_steps": 2, "guidance_scale": 1.0})
    ours = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))))
    theirs = diffusers_pixels(folder, width=32, height=32, num_inference_steps=2,
                              guidance_scale=1.0)
    assert ours.shape == (32, 32, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1
    assert reply.usage is not None and reply.usage.input_tokens > 0
