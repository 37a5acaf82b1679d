"""Both showcase pipelines under ``omni run --cluster`` give what they give locally: the same
token ids and WAV bytes for the dialogue, the same PNG bytes for image generation. Their
values (dataclasses, prompts with images and audio, token streams into the speech decoder)
cross to the workers as themselves. The head and workers are ``omni cluster start`` and
``omni cluster join`` processes, as a user starts them; ``omni run`` runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster._local import invoke
from tests.cluster.conftest import ROOT, Cluster

DIALOGUE = str(ROOT / "examples" / "omni_dialogue.py")
TURNS = str(ROOT / "examples" / "dialogue_turns.jsonl")
IMAGES = str(ROOT / "examples" / "image_generation.py")
SPLIT = str(ROOT / "tests" / "cluster" / "image_split.py")  # its two model stages on w1, w2


def omni_run(folder: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> list[dict]:
    """``omni run ARGS --json`` in `folder`; its outputs."""
    folder.mkdir()
    with monkeypatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("OMNI_DIALOGUE_OUT", str(folder))
        done = invoke("run", *args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["output"] for line in done.stdout.splitlines()]


def check_showcase_pipelines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             *cluster: str) -> None:
    """Both showcase pipelines run locally and with the `cluster` options give the same token
    ids, WAV and PNG bytes; the dialogue's later turns reuse KV on their worker."""
    local = omni_run(tmp_path / "local", monkeypatch, DIALOGUE, "--inputs-json", TURNS)
    remote = omni_run(tmp_path / "remote", monkeypatch, DIALOGUE, "--inputs-json", TURNS,
                      *cluster)
    assert len(local) == len(remote) == 4
    for here, there in zip(local, remote, strict=True):
        assert (there["session"], there["turn"]) == (here["session"], here["turn"])
        assert there["token_ids"] == here["token_ids"] and len(here["token_ids"]) > 0
        assert there["cached_tokens"] == here["cached_tokens"]
        assert Path(there["wav"]).read_bytes() == Path(here["wav"]).read_bytes()
    assert sum(r["cached_tokens"] for r in remote) > 0  # sessions reused KV on their worker

    image = ["--input", "prompt=a red fox in snow", "--input", "out=fox.png"]
    (png_here,) = omni_run(tmp_path / "local-image", monkeypatch, IMAGES, *image)
    (png_there,) = omni_run(tmp_path / "remote-image", monkeypatch, IMAGES, *image, *cluster)
    assert Path(png_there["out"]).read_bytes() == Path(png_here["out"]).read_bytes()
    assert png_there["expansion_tokens"] == png_here["expansion_tokens"] > 0
    assert png_there["prompt_tokens_reused"] == png_here["prompt_tokens_reused"] > 0


@pytest.mark.proc
def test_the_showcase_pipelines_give_the_same_bytes_on_the_cluster(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    assert cluster.address is not None
    check_showcase_pipelines(tmp_path, monkeypatch, "--cluster", cluster.address,
                             "--token-file", str(cluster.token))
    # the language model stage on w1, the diffusion stage on w2: the first request's prompt
    # pages follow it from one worker to the other, and it reuses what a local run reuses
    image = ["--input", "prompt=a grey heron by a pond", "--input", "out=heron.png"]
    (here,) = omni_run(tmp_path / "split-local", monkeypatch, SPLIT, *image)
    (there,) = omni_run(tmp_path / "split-remote", monkeypatch, SPLIT, *image, "--cluster",
                        cluster.address, "--token-file", str(cluster.token))
    assert there["prompt_tokens_reused"] == here["prompt_tokens_reused"] > 0
    assert Path(there["out"]).read_bytes() == Path(here["out"]).read_bytes()
