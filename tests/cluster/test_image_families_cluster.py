"""A real image family's two models on two workers of a hand-joined cluster (real processes):
Z-Image's text side, or Cosmos3's understanding expert, on w1, the diffusion side on w2
(`tests/cluster/z_image_split.py`, `cosmos3_split.py`). Each request's PNG is the one a
local run writes, byte for byte, and the second request, sharing the first's style preamble,
reads it from w1's store as a local run does. tests/cluster/
test_ray.py runs the same on `--cluster ray` (`check_split`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster._local import invoke
from tests.cluster.conftest import ROOT, Cluster
from tests.compute.cosmos3_builders import save_cosmos3
from tests.compute.image_builders import save_z_image

# each family's split graphs, and the folder of a tiny random checkpoint of it
SPLITS = {"z_image": (str(ROOT / "tests" / "cluster" / "z_image_split.py"), save_z_image),
          "cosmos3": (str(ROOT / "tests" / "cluster" / "cosmos3_split.py"), save_cosmos3)}
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


def check_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, graph: str,
                *cluster: str) -> None:
    """Two requests sharing a style preamble through `family`'s split `graph`, locally and
    with the `cluster` options: the same PNG bytes and usage; the second reads cached tokens
    (the preamble; Cosmos3's system prompt too)."""
    module, save = SPLITS[family]
    monkeypatch.setenv("OMNI_MODEL", str(save(tmp_path / family)))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": STYLE + subject, "out": f"{i}.png"}) + "\n"
                                for i, subject in enumerate(("A fern.", "A thistle."))))
    here = omni_run(tmp_path / "local", monkeypatch, module, graph, "--inputs-json",
                    str(requests))
    there = omni_run(tmp_path / "remote", monkeypatch, module, graph, "--inputs-json",
                     str(requests), *cluster)
    for local, remote in zip(here, there, strict=True):
        assert Path(remote["out"]).read_bytes() == Path(local["out"]).read_bytes()
        assert remote["usage"] == local["usage"]
    # the second request read more from cache: the preamble (within the first, Cosmos3's
    # negative prompt already read the system prompt the prompt had stored)
    assert there[0]["usage"]["cached_tokens"] < there[1]["usage"]["cached_tokens"]


@pytest.mark.proc
@pytest.mark.parametrize("family", list(SPLITS))
def test_a_familys_two_models_on_two_workers_paint_the_local_png(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    assert cluster.address is not None
    check_split(tmp_path, monkeypatch, family, f"{family}_split", "--cluster", cluster.address,
                "--token-file", str(cluster.token))
