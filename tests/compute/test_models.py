"""DecoderLM against transformers (the oracle): logits, greedy decoding, KV reuse, masks, pages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from omni.compute.models import (
    DecoderConfig,
    DecoderLM,
    RopeScaling,
    load_pretrained,
    save_pretrained,
    tiny_model,
)
from omni.kv import KVLayout
from tests.compute.checkpoint_builders import draw_experts, is_expert_weight

TOL = 1e-4
HF_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
              "qwen3": (Qwen3Config, Qwen3ForCausalLM),
              "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
# (architecture, tie_word_embeddings, num_kv_heads): GQA and MHA, tied and untied, every arch.
# Qwen3's config.json here leaves head_dim out: transformers' default (128) is not 64 / 4.
VARIANTS = [("llama", False, 2), ("llama", True, 4), ("qwen2", True, 2), ("qwen2", False, 1),
            ("qwen3", True, 2), ("qwen3", False, 4), ("qwen3_moe", False, 2),
            ("qwen3_moe", True, 4)]


def moe_extra(tie: bool) -> dict[str, Any]:
    """8 experts, top 2: untied with the routing weights renormalised and layer 1 dense, tied
    with neither."""
    return {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": not tie, "mlp_only_layers": [] if tie else [1]}


def make_hf(arch: str, *, tie: bool = False, num_kv_heads: int = 2, seed: int = 0,
            **extra: Any) -> torch.nn.Module:
    """A small random HF model; every parameter (norms and biases too) is perturbed, so that a
    tensor loaded into the wrong place cannot go unnoticed."""
    config_cls, model_cls = HF_CLASSES[arch]
    if arch == "qwen3_moe":
        extra = {**moe_extra(tie), **extra}
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=num_kv_heads,
                        max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1,
                        eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_expert_weight(name):
                param.add_(torch.randn_like(param) * (0.1 if "norm" in name else 0.15))
    draw_experts(model, 0.15)  # transformers leaves these empty or zero
    return model.eval()


def save_hf(model: torch.nn.Module, directory: Path, **kwargs: Any) -> Path:
    """`save_pretrained` (transformers 5 writes safetensors only: safe_serialization is gone)."""
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-tied{v[1]}-kv{v[2]}")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(hf model, our model loaded from its safetensors checkpoint, our config)."""
    arch, tie, num_kv_heads = request.param
    hf = make_hf(arch, tie=tie, num_kv_heads=num_kv_heads)
    model, config = load_pretrained(save_hf(hf, tmp_path_factory.mktemp(arch)))
    return hf, model, config


def prompts(batch: int = 3, length: int = 12, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def full_logits(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    hidden, _ = model(model.embed(ids), positions)
    return model.logits(hidden)


def greedy(model: DecoderLM, ids: torch.Tensor, num_new: int, eos: tuple[int, ...]) -> list[int]:
    """Prefill, then one token at a time with the past KV (the engine's decode loop, B = 1)."""
    hidden, past = model(model.embed(ids), torch.arange(ids.shape[1])[None])
    out: list[int] = []
    for _ in range(num_new):
        token = int(model.logits(hidden[:, -1]).argmax(-1))
        out.append(token)
        if token in eos:
            break
        position = torch.tensor([[ids.shape[1] + len(out) - 1]])
        hidden, new = model(model.embed(torch.tensor([[token]])), position, past)
        past = [(torch.cat((k, nk), 2), torch.cat((v, nv), 2)) for (k, v), (nk, nv) in zip(
            past, new, strict=True)]
    return out


@torch.inference_mode()
def test_logits_match_transformers(pair) -> None:
    """A batch of prompts gives HF's logits within 1e-4 (GQA/MHA, tied/untied, llama/qwen2)."""
    hf, model, _ = pair
    ids = prompts()
    diff = (full_logits(model, ids) - hf(ids).logits).abs().max().item()
    print(f"max |logit diff| = {diff:.2e}")
    assert diff < TOL


@torch.inference_mode()
def test_greedy_generation_equals_hf_generate(pair) -> None:
    """20 greedy tokens decoded with `past` equal `generate(do_sample=False)` token for token."""
    hf, model, config = pair
    for ids in prompts(batch=2, length=7, seed=5).split(1):
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=20, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert greedy(model, ids, 20, config.eos_token_ids) == expected


@torch.inference_mode()
def test_incremental_and_chunked_decoding_equal_one_forward(pair) -> None:
    """Prefill 5, a 4-token chunk with past (causal offset mask), then single tokens: the logits
    of one forward over the whole sequence (within 1e-4: GEMMs of other shapes round otherwise)."""
    _, model, _ = pair
    ids = prompts(batch=2, length=14, seed=7)
    reference = full_logits(model, ids)
    past, pieces, start = None, [], 0
    for end in (5, 9, *range(10, 15)):
        chunk = ids[:, start:end]
        hidden, new = model(model.embed(chunk), torch.arange(start, end).expand_as(chunk), past)
        past = new if past is None else [(torch.cat((k, nk), 2), torch.cat((v, nv), 2))
                                         for (k, v), (nk, nv) in zip(past, new, strict=True)]
        pieces.append(model.logits(hidden))
        start = end
    assert (torch.cat(pieces, 1) - reference).abs().max().item() < TOL


def padded_batch(rows: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, ...]:
    """(ids, positions, mask [B, 1, T, T], real [B, T]) for rows padded to one length."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    real = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, row in enumerate(rows):
        span = slice(length - len(row), length) if left else slice(0, len(row))
        ids[b, span], real[b, span] = row, True
    positions = (real.cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return ids, positions, (causal & real[:, None, :])[:, None], real


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@torch.inference_mode()
def test_padded_batch_with_mask_equals_rows_alone(pair, left: bool) -> None:
    """Rows of different lengths, padded and masked, give each row's own logits, in prefill and
    in one decode step after it; fully masked padding rows cause no NaN."""
    _, model, _ = pair
    rows = [prompts(1, n, seed=n)[0] for n in (9, 4, 6)]
    ids, positions, mask, real = padded_batch(rows, left)
    hidden, past = model(model.embed(ids), positions, mask=mask)
    logits = model.logits(hidden)
    assert not logits.isnan().any()
    step_ids = torch.tensor([[5], [6], [7]])
    step_mask = torch.cat((real, torch.ones(3, 1, dtype=torch.bool)), 1)[:, None, None]
    step_pos = real.sum(1, keepdim=True)
    step_hidden, _ = model(model.embed(step_ids), step_pos, past, step_mask)
    for b, row in enumerate(rows):
        alone = full_logits(model, row[None])[0]
        assert (logits[b][real[b]] - alone).abs().max().item() < TOL
        extended = full_logits(model, torch.cat((row, step_ids[b]))[None])[0, -1]
        assert (model.logits(step_hidden[b, 0]) - extended).abs().max().item() < TOL


@torch.inference_mode()
def test_explicit_causal_mask_equals_no_mask(pair) -> None:
    """mask = causal gives the logits of mask=None (the masked path folds GQA groups correctly)."""
    _, model, _ = pair
    ids = prompts(batch=2, length=10)
    mask = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    hidden, _ = model(model.embed(ids), torch.arange(10).expand_as(ids), mask=mask)
    assert (model.logits(hidden) - full_logits(model, ids)).abs().max().item() < TOL


@torch.inference_mode()
def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    """A checkpoint split into shards (model.safetensors.index.json) loads the same model."""
    hf = make_hf("llama", num_kv_heads=2)
    directory = save_hf(hf, tmp_path, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*.safetensors"))) > 2
    model, _ = load_pretrained(directory)
    ids = prompts()
    assert (full_logits(model, ids) - hf(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
], ids=["llama3", "linear"])
@torch.inference_mode()
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict[str, Any]) -> None:
    """llama3 and linear RoPE scaling give HF's logits at positions up to 300."""
    hf = make_hf("llama", rope_parameters=dict(rope))
    model, config = load_pretrained(save_hf(hf, tmp_path))
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == rope["rope_type"]
    ids = prompts(batch=1, length=300)
    assert (full_logits(model, ids) - hf(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@torch.inference_mode()
def test_our_save_pretrained_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    """tiny_model saved by save_pretrained loads in transformers with the same logits, and back
    in load_pretrained with the same config."""
    extra = moe_extra(tie=False) if arch == "qwen3_moe" else {}
    model, config = tiny_model(seed=3, architecture=arch, tie_word_embeddings=arch == "qwen2",
                               **extra)
    if config.qk_norm:  # norms of one: perturb them, so that a misplaced one shows
        for layer in model.layers:
            layer.attn.q_norm.weight.normal_(1.0, 0.2)
            layer.attn.k_norm.weight.normal_(1.0, 0.2)
    save_pretrained(model, config, tmp_path)
    hf = HF_CLASSES[arch][1].from_pretrained(tmp_path).eval()
    ids = prompts(vocab=config.vocab_size)
    assert (full_logits(model, ids) - hf(ids).logits).abs().max().item() < TOL
    reloaded, reloaded_config = load_pretrained(tmp_path)
    assert reloaded_config == config
    assert torch.equal(full_logits(reloaded, ids), full_logits(model, ids))


@torch.inference_mode()
def test_kv_pages_round_trip_exactly() -> None:
    """kv_from_pages and kv_to_pages are inverse; start skips stored pages, a partial page drops."""
    pages = torch.randn(3, 2, 2, 4, 2, 8)  # [n, L, 2, P, Hkv, D]
    kv = DecoderLM.kv_from_pages(pages)
    assert kv[1][0].shape == (1, 2, 12, 8) and kv[1][0].is_contiguous()
    assert torch.equal(kv[1][1][0, :, 4:8], pages[1, 1, 1].transpose(0, 1))
    assert torch.equal(DecoderLM.kv_to_pages(kv, 0, 4), pages)
    assert torch.equal(DecoderLM.kv_to_pages(kv, 4, 4), pages[1:])
    partial = [(k[:, :, :11], v[:, :, :11]) for k, v in kv]
    assert torch.equal(DecoderLM.kv_to_pages(partial, 0, 4), pages[:2])
    assert DecoderLM.kv_to_pages(kv, 0, 4, dtype=torch.float16).dtype == torch.float16


@torch.inference_mode()
def test_prefix_from_pages_equals_recompute() -> None:
    """A prefix's KV (contiguous) stored as pages and read back as `past` gives bit for bit the
    logits of the KV kept in memory, and those of one full forward within 1e-4."""
    model, config = tiny_model(seed=1)
    ids = prompts(batch=1, length=21, vocab=config.vocab_size)
    _, kv = model(model.embed(ids[:, :16]), torch.arange(16)[None])
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in kv)
    pages = DecoderLM.kv_to_pages(kv, 0, 8)
    assert pages.shape == (2, *config.kv_layout(8, torch.float32).page_shape)
    suffix, positions = model.embed(ids[:, 16:]), torch.arange(16, 21)[None]
    from_pages, _ = model(suffix, positions, DecoderLM.kv_from_pages(pages))
    in_memory, _ = model(suffix, positions, kv)
    assert torch.equal(from_pages, in_memory)
    full = full_logits(model, ids)[:, 16:]
    assert (model.logits(from_pages) - full).abs().max().item() < TOL


def test_config_round_trips_through_hf_dict() -> None:
    """to_hf / from_hf round trip, transformers-4 RoPE spelling is read, kv_layout fits."""
    config = DecoderConfig("llama", 100, 32, 64, 3, 4, 2, rope_theta=5e5, eos_token_ids=(2, 7),
                           attention_bias=True, rope_scaling=RopeScaling("llama3", 8.0))
    assert DecoderConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config
    old = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "rope_theta": 5e5, "attention_bias": True, "bos_token_id": 1,
           "eos_token_id": [2, 7], "max_position_embeddings": 4096,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert DecoderConfig.from_hf(old) == DecoderConfig(**{**config.__dict__, "bos_token_id": 1})
    assert config.kv_layout(16, torch.float16) == KVLayout(3, 2, 8, 16, torch.float16)
    qwen = DecoderConfig.from_hf({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                                  "intermediate_size": 16, "num_hidden_layers": 1,
                                  "num_attention_heads": 2})
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.num_kv_heads == 2


@torch.inference_mode()
def test_bfloat16_load_matches_transformers_bfloat16(tmp_path: Path) -> None:
    """Loaded in bfloat16, the logits match HF's bfloat16 model within two bf16 ulps at 8."""
    directory = save_hf(make_hf("llama", num_kv_heads=2), tmp_path)
    model, _ = load_pretrained(directory, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    ids = prompts()
    assert (full_logits(model, ids) - hf(ids).logits.float()).abs().max().item() <= 0.0625


def test_bfloat16_model_keeps_float32_rope_and_returns_float32_logits() -> None:
    """Casting the model to bfloat16 leaves inv_freq in float32; logits come back float32."""
    model, config = tiny_model()
    model = model.to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    ids = prompts(batch=1, length=5, vocab=config.vocab_size)
    with torch.inference_mode():
        assert full_logits(model, ids).dtype == torch.float32


def test_tiny_model_is_deterministic_per_seed() -> None:
    """The same seed gives the same weights, another seed different ones."""
    a, _ = tiny_model(seed=4)
    b, _ = tiny_model(seed=4)
    c, _ = tiny_model(seed=5)
    assert torch.equal(a.layers[1].mlp.down_proj.weight, b.layers[1].mlp.down_proj.weight)
    assert not torch.equal(a.layers[1].mlp.down_proj.weight, c.layers[1].mlp.down_proj.weight)


def test_forward_rejects_shapes_that_do_not_fit() -> None:
    """Wrong positions, past or mask shapes (or a non-bool mask) are ValueErrors saying which."""
    model, _ = tiny_model()
    hidden = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] with B, T = 2, 3"):
        model(hidden, torch.zeros(3, dtype=torch.long))
    past = [(torch.zeros(2, 2, 5, 16), torch.zeros(2, 2, 5, 16))]
    with pytest.raises(ValueError, match="past has 1 layers, the model 2"):
        model(hidden, torch.zeros(2, 3, dtype=torch.long), past)
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \[B, 1, T, T_past \+ T\]"):
        model(hidden, torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 1, 3, 3))


@torch.inference_mode()
def test_qwen3_config_reads_head_dim_bias_and_qk_norm(tmp_path: Path) -> None:
    """Qwen3: head_dim from config.json (128 when left out, as transformers), attention_bias on
    q/k/v and o, q/k norm weights of head_dim; its logits match HF's with attention_bias too."""
    base = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    config = DecoderConfig.from_hf(base)
    assert config.head_dim == 128 and config.qk_norm and not config.attention_bias
    biased = DecoderConfig.from_hf({**base, "head_dim": 16, "attention_bias": True})
    assert biased.head_dim == 16 and biased.attention_bias and biased.o_proj_bias
    assert DecoderConfig.from_hf(json.loads(json.dumps(biased.to_hf()))) == biased
    hf = make_hf("qwen3", head_dim=24, attention_bias=True)
    model, loaded = load_pretrained(save_hf(hf, tmp_path))
    assert loaded.head_dim == 24 and model.layers[0].attn.q_norm.weight.shape == (24,)
    ids = prompts()
    assert (full_logits(model, ids) - hf(ids).logits).abs().max().item() < TOL

