"""Checkpoints built in tests, the way transformers writes them: random tiny weights, a
byte-level BPE tokenizer trained here with ChatML special tokens, a chat template and
generation_config.json; and transformers' own chat + generate as the oracle."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello world, how are you today?"},
            {"role": "assistant", "content": "The quick brown fox."},
            {"role": "user", "content": "And the lazy dog?"}]
HF_MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "qwen3": (Qwen3Config, Qwen3ForCausalLM),
             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
# 8 experts, top 2, renormalised; layer 1 dense
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True, "mlp_only_layers": [1]}


def is_expert_weight(name: str) -> bool:
    """A mixture-of-experts expert's or router's weight (what transformers' `_init_weights`
    leaves empty or zero)."""
    return ".experts." in name or name.endswith("mlp.gate.weight")


def draw_experts(model: Any, std: float) -> None:
    """Draw a model's expert and router weights from normal(0, std)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_expert_weight(name):
                param.normal_(0.0, std)


def train_bpe(corpus: list[str], specials: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on `corpus` (20 times over), `specials` numbered
    first: its tokenizer.json text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    return tok.to_str()


@lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """A byte-level BPE tokenizer trained on a few sentences, ChatML tokens as special tokens."""
    corpus = [m["content"] for m in MESSAGES] + ["system user assistant tools text <b>&</b>"]
    return train_bpe(corpus, SPECIALS, 384)


def save_tokenizer(directory: Path, template: Any = CHATML, **special: Any) -> Path:
    """The trained tokenizer saved by transformers' PreTrainedTokenizerFast.save_pretrained."""
    tok = Tokenizer.from_str(trained_tokenizer_json())
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **special}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)
    hf.save_pretrained(directory)
    return directory


def save_checkpoint(directory: Path, arch: str, generation: dict[str, Any] | None = None,
                    seed: int = 0, **sizes: Any) -> Path:
    """Random tiny `arch` weights (every parameter perturbed), the tokenizer, and
    generation_config.json (`generation`, or greedy with <|im_end|> as EOS); `sizes` are
    config fields over the tiny ones (hidden_size=512, ...: a larger model)."""
    config_cls, model_cls = HF_MODELS[arch]
    extra = {"head_dim": 16} if arch.startswith("qwen3") else {}  # not hidden / heads (8)
    if arch == "qwen3_moe":
        extra.update(MOE)
    dims = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, **extra, **sizes}
    config = config_cls(vocab_size=384, tie_word_embeddings=arch == "qwen2", eos_token_id=2,
                        **dims)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_expert_weight(name):
                param.add_(torch.randn_like(param) * (0.1 if "norm" in name else 0.15))
    draw_experts(model, 0.15)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    GenerationConfig(**(generation or {"do_sample": False, "eos_token_id": 2})).save_pretrained(
        directory)
    return directory


def hf_chat(directory: Path, messages: list[dict[str, Any]], **generate: Any) -> list[int]:
    """transformers: apply_chat_template(add_generation_prompt=True), then generate: new ids."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long),
                             **generate)
    return out[0, len(ids):].tolist()
