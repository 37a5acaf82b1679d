"""examples/image_generation.py with ``OMNI_MODEL`` a Z-Image folder (diffusers' layout), beyond
what every family does (tests/e2e/test_image_families.py): edits, a style preamble's cached
tokens per tenant, concurrent requests denoised together, the README's client code; and a
folder of a family Omni does not serve refused in one line naming it."""

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
from tests._wait import wait_until_sync
from tests.compute.image_builders import save_z_image
from tests.serve._inproc import served

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "image_generation.py"
PROMPT = "A red fox asleep in fresh snow, watercolour."


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_z_image(tmp_path_factory.mktemp("z_image_folder"))


STYLE = ("In the style of a nineteenth-century botanical plate: fine ink lines, soft "
         "watercolour washes, a cream paper ground, labelled in copperplate. ")


async def test_served_usage_counts_the_cached_style_preamble_of_the_callers_own_tenant(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``usage.input_tokens_details.cached_tokens``: 0 for a first request, the shared
    preamble's full pages for a second prompt sharing it, none for another cache salt (a
    tenant's salt goes into every key the same way)."""
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    settings = {"seed": 1, "num_inference_steps": 1, "guidance_scale": 0.0}

    async def usage(prompt: str, **extra: str) -> tuple[int, int]:
        reply = await client.images.generate(prompt=prompt, size="32x32",
                                             extra_body={**settings, **extra})
        assert reply.usage is not None
        return reply.usage.input_tokens, reply.usage.input_tokens_details.cached_tokens

    async with served(EXAMPLE) as app, app.openai() as client:
        tokens, cached = await usage(STYLE + "A fern.")
        assert tokens > 64 and cached == 0
        _, cached = await usage(STYLE + "A thistle.")
        assert 16 <= cached < tokens
        _, cached = await usage(STYLE + "A thistle.", cache_salt="another")
        assert cached == 0


def test_a_folder_of_another_family_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    done = run_omni("run", str(EXAMPLE), "--input=prompt=x", "--input=out=x.png",
                    env={"OMNI_MODEL": str(tmp_path)})
    assert done.returncode == 2, done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert "FluxPipeline" in line and "it serves ZImagePipeline" in line


def test_omni_run_edits_the_image_as_diffusers_img2img_does(folder: Path,
                                                            tmp_path: Path) -> None:
    """With `image` (a file's path) the library's pipeline edits it: the PNG diffusers' own
    ``ZImageImg2ImgPipeline`` saves for the same request (`strength` its)."""
    from diffusers import ZImageImg2ImgPipeline

    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (36, 44, 3), dtype=np.uint8))
    picture.save(tmp_path / "fox.png")
    out = tmp_path / "dusk.png"
    done = run_omni("run", str(EXAMPLE), f"--input=prompt={PROMPT}", f"--input=out={out}",
                    f"--input=image={tmp_path / 'fox.png'}", "--input=strength=0.8",
                    "--input=steps=4", "--input=guidance=4.0", "--input=seed=3", "--json",
                    env={"OMNI_MODEL": str(folder)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output"]["width"] == 44
    pipeline = ZImageImg2ImgPipeline.from_pretrained(folder)
    theirs = np.asarray(pipeline(PROMPT, image=picture, strength=0.8, num_inference_steps=4,
                                 guidance_scale=4.0,
                                 generator=torch.Generator().manual_seed(3)).images[0])
    ours = np.asarray(Image.open(out))
    assert ours.shape == (36, 44, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


@pytest.mark.proc  # a real `omni serve`, and the README's client code in its own interpreter
def test_the_readmes_client_example_runs_against_a_served_folder(folder: Path,
                                                                 tmp_path: Path) -> None:
    """The README's Real image families ``py`` block as written, but for the server's URL
    and a 32 x 32 image (the tiny model's): a generation, an edit of the PNG `omni run`
    wrote, the cached tokens printed."""
    import re
    import subprocess
    import sys

    from tests.serve._server import Server

    text = (ROOT / "README.md").read_text()
    start = text.index("### Real image families")
    (block,) = re.findall(r"```py\n(.*?)```", text[start:text.index("\n### ", start + 4)],
                          flags=re.S)
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "fox.png")
    server = Server(EXAMPLE, (), tmp_path, env={"OMNI_MODEL": str(folder)})
    try:
        url = server.wait_url()
        script = block.replace("http://127.0.0.1:8001", url).replace('"1024x1024"', '"32x32"')
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, text=True,
                              capture_output=True, timeout=300)
    finally:
        status = server.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().isdigit()
    assert status == 0, server.stderr()


async def test_concurrent_images_are_denoised_together_each_diffusers_own(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`n` = 3 on one request: its three runs reach the replica at once and are denoised as
    one batch; each image is diffusers' own for its seed (`seed + i`); each run's steps are
    counted on ``/metrics``."""
    from omni.compute.z_image import ZImagePainter
    from omni.pipelines._batch import Batcher

    sizes: list[int] = []
    arrived: list[object] = []
    paint, submit = ZImagePainter.paint, Batcher.__call__

    async def counted(self: Batcher, key: Any, item: Any) -> Any:
        arrived.append(key)
        return await submit(self, key, item)

    def recorded(self: ZImagePainter, conditions: list[Any], *args: Any, **settings: Any
                 ) -> Any:
        sizes.append(len(conditions))
        # the first batch paints once all three calls have reached the replica (whatever the
        # machine's speed): the others wait meanwhile, and are denoised together
        wait_until_sync(lambda: len(arrived) == 3, "the three runs at the replica")
        return paint(self, conditions, *args, **settings)

    monkeypatch.setattr(Batcher, "__call__", counted)
    monkeypatch.setattr(ZImagePainter, "paint", recorded)
    monkeypatch.setenv("OMNI_MODEL", str(folder))
    async with served(EXAMPLE) as app, app.openai() as client:
        reply = await client.images.generate(
            prompt=PROMPT, size="32x32", n=3, extra_body={
                "seed": 3, "num_inference_steps": 2, "guidance_scale": 0.0})
        async with app.http() as http:
            scraped = (await http.get("/metrics")).text
    # each image's two steps on /metrics, whichever call's task ran its batch
    assert 'omni_node_steps_total{node="ZImagePaint"} 6.0' in scraped, scraped
    assert 'omni_node_steps_remaining{node="ZImagePaint"} 0.0' in scraped
    from diffusers import ZImagePipeline

    pipeline = ZImagePipeline.from_pretrained(folder)
    for i, image in enumerate(reply.data):
        ours = np.asarray(Image.open(io.BytesIO(base64.b64decode(image.b64_json))))
        theirs = np.asarray(pipeline(PROMPT, width=32, height=32, num_inference_steps=2,
                                     guidance_scale=0.0,
                                     generator=torch.Generator().manual_seed(3 + i)).images[0])
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1
    assert sum(sizes) == 3 and max(sizes) > 1, sizes
