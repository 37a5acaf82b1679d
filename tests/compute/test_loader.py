"""load_pretrained on bad input: each problem is one clear error that names it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni.compute.models import DecoderConfig, load_pretrained, save_pretrained, tiny_model


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A valid tiny llama checkpoint (GQA, untied) written by save_pretrained."""
    model, config = tiny_model(seed=2)
    save_pretrained(model, config, tmp_path)
    return tmp_path


def rewrite_weights(directory: Path, change: Any) -> None:
    """Apply `change(tensors)` to model.safetensors in place."""
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(directory: Path, **changes: Any) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_missing_directory_is_named(tmp_path: Path) -> None:
    """A path that is not a directory: FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match=r"no such directory: .*nowhere"):
        load_pretrained(tmp_path / "nowhere")


def test_missing_config_json(tmp_path: Path) -> None:
    """A directory without config.json says so."""
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        load_pretrained(tmp_path)


def test_invalid_config_json(checkpoint: Path) -> None:
    """config.json that is not JSON: ValueError naming the file."""
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*config\.json"):
        load_pretrained(checkpoint)


def test_no_safetensors_weights(checkpoint: Path) -> None:
    """Without model.safetensors or an index (e.g. only a pickle) the error says what is read."""
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    message = (f"no model.safetensors or model.safetensors.index.json in {checkpoint}; "
               "only safetensors checkpoints are loaded")
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        load_pretrained(checkpoint)


def test_unsupported_architecture(checkpoint: Path) -> None:
    """Another architecture is refused, listing the supported ones."""
    rewrite_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = ("unsupported architecture 'GPT2LMHeadModel'; "
               "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_pretrained(checkpoint)


def test_weight_with_wrong_shape(checkpoint: Path) -> None:
    """A misshapen tensor is named with its shape and the config's."""
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    rewrite_weights(checkpoint, shrink)
    with pytest.raises(ValueError, match=re.escape(
            "wrong shape: model.layers.1.mlp.up_proj.weight [100, 64] "
            "(config.json says [128, 64])")):
        load_pretrained(checkpoint)


def test_missing_and_unexpected_tensors(checkpoint: Path) -> None:
    """A missing tensor and an unknown one are both listed, in one error."""
    def rename(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.k_proj.wieght"] = tensors.pop(
            "model.layers.0.self_attn.k_proj.weight")
    rewrite_weights(checkpoint, rename)
    with pytest.raises(ValueError, match=re.escape(
            "missing: model.layers.0.self_attn.k_proj.weight; "
            "unexpected: model.layers.0.self_attn.k_proj.wieght")):
        load_pretrained(checkpoint)


def test_many_missing_tensors_are_summarised(checkpoint: Path) -> None:
    """A config with more layers than the weights lists a few names and counts the rest."""
    rewrite_config(checkpoint, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"missing: model\.layers\.2\..* and 13 more"):
        load_pretrained(checkpoint)


def test_unknown_rope_scaling(checkpoint: Path) -> None:
    """RoPE scaling other than none / linear / llama3 is refused by name."""
    rewrite_config(checkpoint, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'; supported: "):
        load_pretrained(checkpoint)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_sliding_window_is_refused(tmp_path: Path, architecture: str) -> None:
    """Qwen2 / Qwen3 with sliding-window layers are refused by name rather than run with full
    attention."""
    model, config = tiny_model(architecture=architecture)
    save_pretrained(model, config, tmp_path)
    rewrite_config(tmp_path, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match=f"unsupported: {architecture} sliding-window attention"):
        load_pretrained(tmp_path)


def test_corrupt_safetensors_file(checkpoint: Path) -> None:
    """A truncated weights file: ValueError naming the file, not a deep library traceback."""
    (checkpoint / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors"):
        load_pretrained(checkpoint)


def test_index_naming_a_missing_shard(checkpoint: Path) -> None:
    """A shard index that names a file that is not there says which."""
    (checkpoint / "model.safetensors").unlink()
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = "names shard 'model-00001-of-00002.safetensors'"
    with pytest.raises(FileNotFoundError, match=re.escape(shard)):
        load_pretrained(checkpoint)


def test_inconsistent_sizes_in_config(checkpoint: Path) -> None:
    """Heads that do not divide the KV heads are a ValueError naming both."""
    rewrite_config(checkpoint, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by num_kv_heads 3"):
        load_pretrained(checkpoint)


def test_tied_checkpoint_carrying_lm_head_and_rope_buffers_loads(tmp_path: Path) -> None:
    """A tied checkpoint that still stores lm_head.weight and old rotary inv_freq buffers loads."""
    model, config = tiny_model(seed=2, tie_word_embeddings=True)
    save_pretrained(model, config, tmp_path)

    def add_extras(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    rewrite_weights(tmp_path, add_extras)
    loaded, _ = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_config_validation_messages() -> None:
    """Bad sizes in a DecoderConfig are ValueErrors that name the field."""
    with pytest.raises(ValueError, match="hidden_size 30 is not divisible by num_heads 4"):
        DecoderConfig("llama", 10, 30, 8, 1, 4, 2)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        DecoderConfig("llama", 10, 32, 8, 0, 4, 2)
    with pytest.raises(ValueError, match="qwen2 always has q/k/v biases"):
        DecoderConfig("qwen2", 10, 32, 8, 1, 4, 2)
    with pytest.raises(ValueError, match=re.escape("config.json has no 'hidden_size'")):
        DecoderConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


def test_qwen3_checkpoint_without_qk_norms_names_them(tmp_path: Path) -> None:
    """A Qwen3 config over weights without q_norm / k_norm (e.g. a Qwen2 checkpoint relabelled)
    lists the missing norms; a qwen3 config with an MLP bias is refused."""
    model, config = tiny_model(architecture="qwen3")
    save_pretrained(model, config, tmp_path)

    def drop_norms(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.0.self_attn.q_norm.weight"]
        del tensors["model.layers.1.self_attn.k_norm.weight"]
    rewrite_weights(tmp_path, drop_norms)
    with pytest.raises(ValueError, match=re.escape(
            "missing: model.layers.0.self_attn.q_norm.weight, "
            "model.layers.1.self_attn.k_norm.weight")):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="qwen3 has no MLP bias"):
        DecoderConfig("qwen3", 10, 32, 8, 1, 4, 2, mlp_bias=True)


@pytest.mark.parametrize("layers", [1, -1])
def test_the_first_layers_alone_are_read_and_give_the_full_models_inner_states(
        checkpoint: Path, layers: int) -> None:
    """A model read at an inner layer loads only the layers before it: what they compute is
    the full model's hidden state there (transformers' ``hidden_states[k]``)."""
    full, config = load_pretrained(checkpoint)
    part, part_config = load_pretrained(checkpoint, layers=layers)
    keep = layers % config.num_layers
    assert part_config.num_layers == len(part.layers) == keep
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    positions = torch.arange(ids.shape[1])[None]
    want = full.hidden_at(keep, full.embed(ids), positions)
    got, _ = part._run_layers(part.embed(ids), positions, None, None, None, None, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("layers", [0, -2, 3])
def test_layers_keeping_none_or_more_than_the_checkpoint_has_is_refused(
        checkpoint: Path, layers: int) -> None:
    with pytest.raises(ValueError, match=rf"layers={layers} keeps -?\d+ of the checkpoint's 2 "
                                         r"decoder layers \(1 to 2 can\)"):
        load_pretrained(checkpoint, layers=layers)
