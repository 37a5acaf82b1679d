"""`DecoderConfig`: the shape of a Llama-family decoder, read from and written to HF config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from omni.kv.layout import KVLayout

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderConfig", "RopeScaling", "is_qwen3_omni",
           "qwen3_omni_part", "weights_prefix"]

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
Activation = Literal["silu", "relu2"]

# config.json "architectures" entry -> our architecture; the model_type is accepted too.
SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # the thinker's text decoder (`thinker.model.*`, `thinker.lm_head.*`): Qwen3-MoE with M-RoPE
    "Qwen3OmniMoeForConditionalGeneration": "qwen3_moe",
}
_OMNI = "Qwen3OmniMoeForConditionalGeneration"
_HF_CLASS = {arch: name for name, arch in SUPPORTED_ARCHITECTURES.items() if name != _OMNI}

# transformers' class defaults, used when config.json leaves a field out.
_HF_DEFAULTS: dict[Architecture, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
    "qwen3": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "head_dim": 128},
    "qwen3_moe": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
# Qwen3OmniMoeTextConfig's defaults (the thinker's text decoder)
_OMNI_TEXT_DEFAULTS = {"vocab_size": 3584, "hidden_size": 2048, "intermediate_size": 18944,
                       "num_hidden_layers": 28, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "max_position_embeddings": 32768,
                       "rope_theta": 1000000.0, "num_experts_per_tok": 8,
                       "moe_intermediate_size": 768, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling, exactly as transformers computes it.

    `"linear"` divides every inverse frequency by `factor`; `"llama3"` (Llama 3.1) divides the low
    frequencies by `factor`, keeps the high ones and interpolates in between.
    """

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; "
                             "supported: none (default), 'linear', 'llama3'")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                             f"{self.high_freq_factor} <= {self.low_freq_factor}")

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` entries of config.json (without `rope_theta`)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True)
class DecoderConfig:
    """The sizes and options of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder-only language model.

    `attention_bias` puts biases on the q/k/v projections (always on for qwen2); Llama and Qwen3
    also put one on the output projection (`o_proj_bias`). Qwen3 normalises each head of q and k
    (RMSNorm over the head dim, `qk_norm`) before RoPE. `head_dim` defaults to
    hidden_size / num_heads.

    Mixture of experts (qwen3_moe): a sparse layer's MLP is `num_experts` SwiGLU experts of
    `moe_intermediate_size`, each token routed to its `num_experts_per_tok` most likely ones
    (their weights renormalised to sum to 1 with `norm_topk_prob`). Layer i is sparse unless it
    is in `mlp_only_layers`, when (i + 1) is a multiple of `decoder_sparse_step`; dense layers
    keep an MLP of `intermediate_size`. With `shared_expert_intermediate_size` (Qwen3-Omni's
    talker) every token also goes through one shared SwiGLU expert, its output scaled by a
    sigmoid gate.

    Multimodal RoPE (`mrope_section`, Qwen3-Omni's thinker): each token has a temporal, a
    height and a width position (equal for text); rotary frequency i turns with the height
    position for i % 3 == 1 and i < 3 * section[1], with the width position for i % 3 == 2 and
    i < 3 * section[2], with the temporal position otherwise (transformers' interleaved layout).

    `hidden_act`: "silu", the SwiGLU MLP every architecture here has; "relu2", the ungated
    MLP of Nemotron's dense layers, down(relu(up(x))^2) (Cosmos3's Nemotron variant). No
    transformers class has the second with these layers: such a config has no config.json.

    Raises:
        ValueError: a size that is not positive, or sizes that do not divide (see `__post_init__`).
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mrope_section: tuple[int, int, int] | None = None
    shared_expert_intermediate_size: int = 0
    hidden_act: Activation = "silu"

    def __post_init__(self) -> None:
        if self.architecture not in _HF_CLASS:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(_HF_CLASS)}")
        if self.hidden_act not in ("silu", "relu2"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; "
                             "supported: 'silu', 'relu2'")
        if self.hidden_act == "relu2" and self.architecture == "qwen3_moe":
            raise ValueError("hidden_act 'relu2' is for dense MLPs: qwen3_moe's experts are "
                             "SwiGLU")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                                 f"{self.num_heads} (give head_dim explicitly)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive_int("head_dim", self.head_dim)
        self._check_consistency()
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.mrope_section is not None:
            self._check_mrope()
        if self.architecture == "qwen3_moe":
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "decoder_sparse_step"):
                _check_positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is more than "
                                 f"num_experts {self.num_experts}")
        elif self.num_experts or self.shared_expert_intermediate_size:
            raise ValueError(f"{self.architecture} has no experts: use qwen3_moe")

    def _check_mrope(self) -> None:
        section = tuple(self.mrope_section or ())
        object.__setattr__(self, "mrope_section", section)
        if (len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section)
                or sum(section) != int(self.head_dim or 0) // 2):
            raise ValueError(f"mrope_section must be 3 non-negative counts of rotary "
                             f"frequencies (temporal, height, width) that sum to head_dim / 2 = "
                             f"{int(self.head_dim or 0) // 2}, got {list(section)}")

    def _check_consistency(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"rope_theta and rms_norm_eps must be positive, got "
                             f"{self.rope_theta} and {self.rms_norm_eps}")
        if self.architecture == "qwen2" and (not self.attention_bias or self.mlp_bias):
            raise ValueError("qwen2 always has q/k/v biases and no MLP bias: "
                             "use attention_bias=True, mlp_bias=False")
        if self.architecture in ("qwen3", "qwen3_moe") and self.mlp_bias:
            raise ValueError(f"{self.architecture} has no MLP bias: use mlp_bias=False")

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias (Llama's and Qwen3's
        attention_bias)."""
        return self.architecture != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised before RoPE (Qwen3, Qwen3-MoE)."""
        return self.architecture in ("qwen3", "qwen3_moe")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_layout(self, page_size: int, dtype: torch.dtype) -> KVLayout:
        """The `omni.kv` page layout of this model's KV cache."""
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=int(self.head_dim or 0), page_size=page_size, dtype=dtype)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """The config of a HF config.json dict (LlamaForCausalLM, Qwen2ForCausalLM,
        Qwen3ForCausalLM, Qwen3MoeForCausalLM, or the thinker's text decoder of a
        Qwen3OmniMoeForConditionalGeneration; a missing field takes transformers' class default).

        Reads both the transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`)
        spellings of RoPE settings.

        Raises:
            ValueError: another architecture, a missing size, unsupported RoPE scaling,
                sliding-window attention or an activation other than silu.
        """
        if is_qwen3_omni(hf):
            return qwen3_omni_part(hf, "thinker")
        arch = _architecture_of(hf)
        fields = {**_HF_DEFAULTS[arch], **hf}
        _check_supported_features(arch, fields)
        theta, scaling = _rope_of(fields)
        eos = fields.get("eos_token_id")
        return cls(
            architecture=arch, vocab_size=_required(fields, "vocab_size"),
            hidden_size=_required(fields, "hidden_size"),
            intermediate_size=_required(fields, "intermediate_size"),
            num_layers=_required(fields, "num_hidden_layers"),
            num_heads=_required(fields, "num_attention_heads"),
            num_kv_heads=fields.get("num_key_value_heads") or fields["num_attention_heads"],
            head_dim=fields.get("head_dim"), rope_theta=float(theta),
            rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=fields["max_position_embeddings"],
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(fields.get("attention_bias", False)),
            mlp_bias=bool(fields.get("mlp_bias", False)) and arch == "llama",
            bos_token_id=fields.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
            rope_scaling=scaling, **_moe_fields(arch, fields))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.x and 5.x) builds the same model from."""
        if self.mrope_section is not None:
            raise ValueError("a decoder with M-RoPE (Qwen3-Omni's thinker) has no config.json "
                             "of its own: it is part of its Qwen3-Omni checkpoint")
        if self.hidden_act != "silu":
            raise ValueError(f"a decoder with hidden_act {self.hidden_act!r} has no "
                             "transformers class: it has no config.json of its own")
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_hf())
        eos = list(self.eos_token_ids)
        out: dict[str, Any] = {
            "architectures": [_HF_CLASS[self.architecture]], "model_type": self.architecture,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "rope_theta": self.rope_theta,
            "rope_parameters": rope, "bos_token_id": self.bos_token_id,
            "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else eos,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()   # the transformers 4 spelling
        if self.architecture == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        else:
            out.update(use_sliding_window=False)
        if self.architecture in ("qwen3", "qwen3_moe"):
            out.update(attention_bias=self.attention_bias)
        if self.architecture == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        return out


# Qwen3OmniMoeTalkerTextConfig's and Qwen3OmniMoeTalkerCodePredictorConfig's defaults
_TALKER_DEFAULTS = {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048,
                    "num_hidden_layers": 20, "num_attention_heads": 16,
                    "num_key_value_heads": 2, "max_position_embeddings": 32768,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 384, "norm_topk_prob": False}
_CODE_PREDICTOR_DEFAULTS = {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
                            "num_hidden_layers": 5, "num_attention_heads": 16,
                            "num_key_value_heads": 8, "head_dim": 128,
                            "max_position_embeddings": 32768}


def qwen3_omni_part(hf: Mapping[str, Any],
                    part: Literal["thinker", "talker", "code_predictor"]) -> DecoderConfig:
    """The decoder config of a Qwen3-Omni checkpoint's thinker (Qwen3-MoE with M-RoPE), its
    talker (Qwen3-MoE with M-RoPE, a shared expert on every layer, all layers sparse) or its
    code predictor (a dense Qwen3)."""
    if not is_qwen3_omni(hf):
        raise ValueError("not a Qwen3-Omni config.json")
    if part == "thinker":
        text = {**_OMNI_TEXT_DEFAULTS, **_omni_thinker_text(hf)}
        base = DecoderConfig.from_hf({**text, "architectures": ["Qwen3MoeForCausalLM"]})
        return replace(base, mrope_section=_mrope_of(text))
    talker = hf.get("talker_config")
    if not isinstance(talker, Mapping):
        raise ValueError("config.json of a Qwen3-Omni checkpoint has no talker_config")
    if part == "code_predictor":
        fields = {**_CODE_PREDICTOR_DEFAULTS, **(talker.get("code_predictor_config") or {})}
        return DecoderConfig.from_hf({**fields, "architectures": ["Qwen3ForCausalLM"]})
    text = {**_TALKER_DEFAULTS, **(talker.get("text_config") or {})}
    base = DecoderConfig.from_hf({**text, "architectures": ["Qwen3MoeForCausalLM"],
                                  "mlp_only_layers": [], "decoder_sparse_step": 1})
    return replace(base, mrope_section=_mrope_of(text),
                   shared_expert_intermediate_size=int(
                       text.get("shared_expert_intermediate_size") or 0))


def weights_prefix(hf: Mapping[str, Any]) -> str:
    """Where the decoder's tensors are in the checkpoint of config.json `hf`: "thinker." for a
    Qwen3-Omni checkpoint (its `thinker.model.*` and `thinker.lm_head.*`), else ""."""
    return "thinker." if is_qwen3_omni(hf) else ""


def is_qwen3_omni(hf: Mapping[str, Any]) -> bool:
    """Whether config.json `hf` is a Qwen3-Omni checkpoint's."""
    archs = hf.get("architectures") or []
    return (archs[0] if archs else hf.get("model_type")) in (_OMNI, "qwen3_omni_moe")


def _omni_thinker_text(hf: Mapping[str, Any]) -> dict[str, Any]:
    thinker = hf.get("thinker_config")
    text = thinker.get("text_config") if isinstance(thinker, Mapping) else None
    if not isinstance(text, Mapping):
        raise ValueError("config.json of a Qwen3-Omni checkpoint has no "
                         "thinker_config.text_config")
    return dict(text)


def _mrope_of(fields: Mapping[str, Any]) -> tuple[int, int, int]:
    """The M-RoPE section of a Qwen3-Omni text config (transformers' default when absent;
    Qwen3-Omni always interleaves, whatever `interleaved` says)."""
    params = dict(fields.get("rope_parameters") or fields.get("rope_scaling") or {})
    section = params.get("mrope_section", [24, 20, 20])
    if not isinstance(section, list | tuple) or len(section) != 3:
        raise ValueError(f"mrope_section must be a list of 3 counts, got {section!r}")
    return (int(section[0]), int(section[1]), int(section[2]))


def _moe_fields(arch: Architecture, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config.json (none for the others)."""
    if arch != "qwen3_moe":
        return {}
    # transformers 5 writes num_local_experts; the published checkpoints say num_experts
    experts = fields.get("num_experts", fields.get("num_local_experts", 128))
    return {"num_experts": experts,
            "num_experts_per_tok": fields["num_experts_per_tok"],
            "moe_intermediate_size": fields["moe_intermediate_size"],
            "norm_topk_prob": bool(fields["norm_topk_prob"]),
            "decoder_sparse_step": fields["decoder_sparse_step"],
            "mlp_only_layers": tuple(fields.get("mlp_only_layers") or ())}


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DecoderConfig.{name} must be a positive integer, got {value!r}")


def _required(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields or fields[key] is None:
        raise ValueError(f"config.json has no {key!r}")
    return fields[key]


def _architecture_of(hf: Mapping[str, Any]) -> Architecture:
    archs = hf.get("architectures") or []
    name = archs[0] if archs else hf.get("model_type")
    if name in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[name]
    if not archs and name in _HF_CLASS:
        return name
    raise ValueError(f"unsupported architecture {name!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_supported_features(arch: Architecture, fields: Mapping[str, Any]) -> None:
    if fields.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {fields['hidden_act']!r}; only 'silu'")
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        layer_types = fields.get("layer_types")
        if layer_types is None and fields.get("use_sliding_window"):
            num_full = fields.get("max_window_layers", 28)
            layer_types = ["sliding_attention"] * max(0, fields["num_hidden_layers"] - num_full)
        if layer_types and "sliding_attention" in layer_types:
            raise ValueError(f"unsupported: {arch} sliding-window attention "
                             "(use_sliding_window=true)")


def _rope_of(fields: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` (4)."""
    params = dict(fields.get("rope_parameters") or fields.get("rope_scaling") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("unsupported: per-layer-type rope_parameters")
    theta = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported: partial_rotary_factor "
                         f"{params['partial_rotary_factor']} (only full rotary embeddings)")
    if rope_type in ("default", None):
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                         "supported: none (default), 'linear', 'llama3'")
    if "factor" not in params:
        raise ValueError(f"rope scaling {rope_type!r} has no 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    try:
        return theta, RopeScaling(
            "llama3", float(params["factor"]), float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings",
                           fields["max_position_embeddings"])))
    except KeyError as missing:
        raise ValueError(f"llama3 rope scaling has no {missing.args[0]!r}") from None
