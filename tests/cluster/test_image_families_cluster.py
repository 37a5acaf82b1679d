"""A real image family's two models on two workers of a hand-joined cluster (real processes):
Z-Image's text side on w1, its diffusion side on w2 (`tests/cluster/z_image_split.py`). Each
request's PNG is the one a local run writes, byte for byte, and the second request, sharing
the first's style preamble, reads it from w1's store as a local run does. tests/cluster/
test_ray.py runs the same on `--cluster ray` (`check_split`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster._local import invoke
from tests.cluster.conftest import ROOT, Cluster
from tests.compute.image_builders import save_z_image

SPLIT = str(ROOT / "tests" / "cluster" / "z_image_split.py")
STYLE = ("In the style of a nineteenth-century botanical plate: fine ink lines, soft "
         "watercolour washes, a cream paper ground, labelled in copperplate. ")


def omni_run(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> list[dict]:
    """``omni run ARGS --json`` in `folder`; its outputs."""
    folder.mkdir()
    with monkeypatch.context() as patch:
        patch.chdir(folder)
        done = invoke("run", *args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["output"] for line in done.stdout.splitlines()]


def check_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graph: str,
                *cluster: str) -> None:
    """Two requests sharing a style preamble through the split `graph`, locally and with the
    `cluster` options: the same PNG bytes and usage; the second reads the preamble cached."""
    monkeypatch.setenv("OMNI_MODEL", str(save_z_image(tmp_path / "z-image")))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": STYLE + subject, "out": f"{i}.png"}) + "\n"
                                for i, subject in enumerate(("A fern.", "A thistle."))))
    here = omni_run(tmp_path / "local", monkeypatch, SPLIT, graph, "--inputs-json",
                    str(requests))
    there = omni_run(tmp_path / "remote", monkeypatch, SPLIT, graph, "--inputs-json",
                     str(requests), *cluster)
    for local, remote in zip(here, there, strict=True):
        assert Path(remote["out"]).read_bytes() == Path(local["out"]).read_bytes()
        assert remote["usage"] == local["usage"]
    assert there[0]["usage"]["cached_tokens"] == 0 < there[1]["usage"]["cached_tokens"]


@pytest.mark.proc
def test_z_images_two_models_on_two_workers_paint_the_local_png(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    assert cluster.address is not None
    check_split(tmp_path, monkeypatch, "z_image_split", "--cluster", cluster.address,
                "--token-file", str(cluster.token))
