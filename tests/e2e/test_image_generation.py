"""examples/image_generation.py through the CLI: a PNG from an LLM role and a diffusion role
sharing one engine and one copy of the prompt's KV; the cached image equals the recomputed
one; bad inputs fail their request with one readable line; `omni graph show`; real
(HF-format) weights from OMNI_MODEL."""

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from typer.testing import CliRunner

from cli.main import app
from omni.compute.models import save_pretrained, tiny_config, tiny_model
from tests._cli import run_omni

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/image_generation.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PAGE_SIZE = 16
FIELDS = {"out", "width", "height", "steps", "prompt_tokens", "prompt_tokens_reused",
          "seconds_per_step", "kv_bytes_resident", "kv_bytes_separate", "timing"}


def omni(*args: str) -> subprocess.CompletedProcess:
    """``omni ARGS`` in this process, with the built-in tiny model (no ``OMNI_MODEL``)."""
    return run_omni(*args, env={"OMNI_MODEL": None})


def write_jsonl(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])


def pixels(path: Path) -> np.ndarray:
    """A PNG's pixels as int16 [H, W, 3] (signed, so that differences do not wrap)."""
    with PILImage.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_a_prompt_becomes_a_png_whose_diffusion_reused_the_llm_roles_kv(tmp_path):
    """One process, three requests: reused KV, recomputed KV (the same image up to float
    rounding: a pixel at most one level apart), and another prompt (another image: the
    prompt's KV does shape it)."""
    size = {"width": 64, "height": 32, "steps": 4}
    lines = [{"prompt": "a red fox in snow", "out": str(tmp_path / "fox.png"), **size},
             {"prompt": "a red fox in snow", "out": str(tmp_path / "baseline.png"),
              "reuse": False, **size},
             {"prompt": "a blue whale at sea", "out": str(tmp_path / "whale.png"), **size}]
    run = omni("run", EXAMPLE, "--inputs-json", write_jsonl(tmp_path / "r.jsonl", lines),
               "--json")
    assert run.returncode == 0, run.stderr
    fox, baseline, whale = (json.loads(line)["output"] for line in run.stdout.splitlines())

    assert FIELDS <= fox.keys()
    assert fox["out"] == str(tmp_path / "fox.png")
    data = (tmp_path / "fox.png").read_bytes()
    assert png_size(data) == (fox["width"], fox["height"]) == (64, 32)
    assert fox["png_bytes"] == len(data)
    assert fox["steps"] == 4 and fox["seconds_per_step"] > 0
    assert fox["llm"] == {"prompt_tokens": len("a red fox in snow"), "cached_tokens": 0}
    assert fox["prompt_tokens"] == fox["llm"]["prompt_tokens"] + fox["expansion_tokens"]
    # What the LLM role cached: the full pages of prompt + expansion (the last token has no KV
    # yet); the diffusion role found them all under the same keys.
    assert fox["prompt_tokens_reused"] == (fox["prompt_tokens"] - 1) // PAGE_SIZE * PAGE_SIZE
    assert fox["prompt_tokens_reused"] > 0
    layout = tiny_config().kv_layout(PAGE_SIZE, torch.float32)
    per_token = layout.page_bytes // layout.page_size
    assert fox["kv_bytes_resident"] == fox["prompt_tokens"] * per_token
    assert fox["kv_bytes_separate"] == 2 * fox["kv_bytes_resident"]
    assert set(fox["timing"]) == {"understand_s", "diffusion_s", "write_s"}

    assert baseline["reuse"] is False and baseline["prompt_tokens_reused"] == 0
    assert baseline["prompt_tokens"] == fox["prompt_tokens"]
    cached, recomputed = (pixels(tmp_path / name) for name in ("fox.png", "baseline.png"))
    assert cached.shape == recomputed.shape == (32, 64, 3)
    assert np.abs(cached - recomputed).max() <= 1  # cached == recomputed, to float rounding
    assert whale["prompt_tokens_reused"] > 0
    assert (tmp_path / "whale.png").read_bytes() != data


def test_bad_inputs_fail_their_requests_with_one_readable_line_each(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    good = {"prompt": "a fox", "out": str(tmp_path / "fox.png")}
    lines = [{**good, "width": 100},
             {**good, "image": str(tmp_path / "missing.png")},
             {**good, "image": str(tmp_path / "notes.png")},
             {**good, "out": str(tmp_path / "no-such-folder" / "fox.png")},
             {**good, "out": str(tmp_path)},
             {**good, "steps": 0}]
    run = omni("run", EXAMPLE, "--inputs-json", write_jsonl(tmp_path / "r.jsonl", lines),
               "--json")
    assert run.returncode == 1
    errors = [json.loads(line)["error"] for line in run.stdout.splitlines()]
    assert [e["node"] for e in errors] == ["check_settings", "read_reference",
                                           "read_reference", "check_out", "check_out",
                                           "check_settings"]
    expected = ["ValueError: width must be a multiple of 16 pixels from 16 to 1024, got 100",
                "missing.png': no such file",
                "notes.png' is not an image (PNG or JPEG expected)",
                f"the folder {tmp_path / 'no-such-folder'} does not exist",
                "must end in .png",
                "ValueError: steps must be an integer from 1 to 1000, got 0"]
    stderr = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(stderr) == len(lines)  # one line per failed request
    for index, (error, line, text) in enumerate(zip(errors, stderr, expected, strict=True)):
        assert text in error["message"]
        assert line == (f"error: node '{error['node']}' failed in request req-{index + 1}: "
                        f"{error['message']}")
    assert not (tmp_path / "fox.png").exists()


def test_graph_show_draws_the_two_roles_between_reading_and_writing(monkeypatch):
    monkeypatch.chdir(ROOT)
    run = CliRunner().invoke(app, ["graph", "show", EXAMPLE, "--format", "mermaid"])
    assert run.exit_code == 0, run.output
    lines = run.stdout.splitlines()
    assert lines[0] == "flowchart TD"
    nodes = {line.split("[")[0].strip(): line.split('"')[1] for line in lines
             if line.strip().startswith("n") and '["' in line}
    edges = {(a, b) for a, _, b in (line.split() for line in lines if "-->|" in line)}
    by_name = {name: key for key, name in nodes.items()}
    assert set(by_name) == {"check_settings", "read_reference", "check_out", "Understand",
                            "Paint", "write_png"}
    for src, dst in [("read_reference", "Understand"), ("check_settings", "Understand"),
                     ("Understand", "Paint"), ("Paint", "write_png"), ("check_out", "write_png")]:
        assert (by_name[src], by_name[dst]) in edges


def test_hf_format_weights_from_omni_model(monkeypatch, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model, config = tiny_model(seed=5)
    save_pretrained(model, config, tmp_path / "model")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    vocab = {c: i + 3 for i, c in enumerate(sorted(byte_level.alphabet()))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "model" / "tokenizer.json"))

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMNI_MODEL", str(tmp_path / "model"))
    run = CliRunner().invoke(app, ["run", EXAMPLE, "--input", "prompt=a red fox in snow",
                                   "--input", f"out={tmp_path / 'fox.png'}", "--input",
                                   "steps=2", "--json"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)["output"]
    assert result["model"] == "model"
    assert result["prompt_tokens_reused"] > 0
    assert png_size((tmp_path / "fox.png").read_bytes()) == (128, 128)



def test_an_omni_model_without_a_config_stops_the_run_before_any_request(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMNI_MODEL", str(tmp_path / "nowhere"))
    run = CliRunner().invoke(app, ["run", EXAMPLE, "--input", "prompt=a fox", "--input",
                                   f"out={tmp_path / 'fox.png'}"])
    assert run.exit_code == 2
    (line,) = run.stderr.splitlines()
    config = tmp_path / "nowhere" / "config.json"
    assert line.startswith(f"error: loading {EXAMPLE} failed at line ")
    assert line.endswith(f"ValueError: OMNI_MODEL='{tmp_path / 'nowhere'}': cannot read {config} "
                         f"([Errno 2] No such file or directory: '{config}'); give a Hugging "
                         "Face model folder, or unset OMNI_MODEL for the built-in tiny model")
