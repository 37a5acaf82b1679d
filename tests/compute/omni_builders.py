"""Tiny random Qwen3-Omni checkpoints built in tests, the way transformers writes them (a
`Qwen3OmniMoeForConditionalGeneration` saved with `save_pretrained`), with a processor saved
beside the weights: a byte-level BPE tokenizer trained here (Qwen3-Omni's special tokens; the
role names single tokens, as the talker reads them), its chat template, a Qwen2-VL image
processor and a Whisper feature extractor. And transformers' own `generate` as the oracle.

Traps a fixture of this model has to handle (transformers 5.25):
- `_init_weights` leaves the MoE experts uninitialised and the routers at zero: both are drawn
  here, and `initializer_range` is raised so that outputs depend on their inputs;
- `generate` suppresses the talker's top 1,024 ids except codec EOS: the talker's vocabulary
  is the codebook plus 1,024 control ids;
- a few keys the code reads but the config classes do not declare (`vision_start_token_id`,
  the talker's `spatial_merge_size` and `shared_expert_intermediate_size`) are given.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from tests.compute.checkpoint_builders import draw_experts, train_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>",
            "<|audio_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
ID = {name: i for i, name in enumerate(SPECIALS)}  # the trainer numbers specials first
CODEBOOK = 64  # codec codes per quantizer
QUANTIZERS = 4  # codec codebooks (the talker's code and the code predictor's 3)
TALKER_VOCAB = CODEBOOK + 1024  # generate() suppresses the top 1,024 except codec EOS
CODEC = {"codec_pad_id": CODEBOOK + 1000, "codec_bos_id": CODEBOOK + 1001,
         "codec_eos_token_id": CODEBOOK + 1002, "codec_nothink_id": CODEBOOK + 1003,
         "codec_think_bos_id": CODEBOOK + 1004, "codec_think_eos_id": CODEBOOK + 1005}
SPEAKERS = {"ethan": CODEBOOK + 1010, "chelsie": CODEBOOK + 1011}

# The chat template of Qwen3-Omni's processor, reduced to text, image and audio parts.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = ["You are a helpful assistant.", "Describe the picture and the sound.",
          "The quick brown fox jumps over the lazy dog.", "What do you hear?",
          "A red square on a blue sky, and a bird singing.", "system", "user", "assistant"]


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    return train_bpe(CORPUS, SPECIALS, 400)


def save_processor(directory: Path, max_pixels: int = 64 * 64) -> PreTrainedTokenizerFast:
    """Tokenizer, chat template, image processor (images resized to at most `max_pixels`)
    and feature extractor, saved as transformers' Qwen3OmniMoeProcessor saves them (built
    from its parts: transformers builds the processor itself only with torchvision, for its
    video processor)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json()), chat_template=TEMPLATE,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
                              "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>",
                              "vision_eos_token": "<|vision_end|>",
                              "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"})
    for role in ("system", "user", "assistant"):
        if len(tokenizer.encode(role)) != 1:
            raise AssertionError(f"{role!r} must be one token for the talker")
    tokenizer.save_pretrained(directory)
    # one preprocessor_config.json holds both, as in Qwen's checkpoints: 8 px patches merged
    # 2x2 (a 64x64 image is 8x8 patches, 16 thinker positions); 16 mel bins
    merged: dict[str, Any] = {"processor_class": "Qwen3OmniMoeProcessor"}
    for part in (Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                          min_pixels=32 * 32, max_pixels=max_pixels),
                 WhisperFeatureExtractor(feature_size=16, sampling_rate=16_000)):
        with tempfile.TemporaryDirectory() as tmp:
            part.save_pretrained(tmp)
            merged.update(json.loads((Path(tmp) / "preprocessor_config.json").read_text()))
    (directory / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    return tokenizer


def omni_config(vocab_size: int, hidden: int = 32, layers: int = 2,
                vision: dict[str, Any] | None = None) -> Any:
    """The tiny config (`hidden` and `layers` of the thinker's and the talker's decoders,
    `vision` fields over the vision tower's: larger for a benchmark)."""
    from transformers import Qwen3OmniMoeConfig

    heads, head_dim = 4, hidden // 4
    quarter = head_dim // 8  # M-RoPE: half the rotary frequencies temporal, a quarter each
    rope = {"rope_type": "default", "rope_theta": 10000.0, "interleaved": True,
            "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]}
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
           "norm_topk_prob": True, "decoder_sparse_step": 1}
    text = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 2, "head_dim": head_dim, "max_position_embeddings": 2048,
            "initializer_range": 0.1, "rope_parameters": rope, **moe}
    thinker = {
        "text_config": text,
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                          "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "out_hidden_size": hidden, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0, 1], "initializer_range": 0.1,
                          **(vision or {})},
        "audio_config": {"num_mel_bins": 16, "encoder_layers": 2, "encoder_attention_heads": 4,
                         "encoder_ffn_dim": 64, "d_model": 32, "output_dim": hidden,
                         "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
                         "downsample_hidden_size": 8, "max_source_positions": 256,
                         "initializer_range": 0.1},
        "audio_token_id": ID["<|audio_pad|>"], "image_token_id": ID["<|image_pad|>"],
        "video_token_id": ID["<|video_pad|>"], "audio_start_token_id": ID["<|audio_start|>"],
        "vision_start_token_id": ID["<|vision_start|>"], "initializer_range": 0.1,
    }
    talker = {
        "text_config": {"vocab_size": TALKER_VOCAB, "hidden_size": hidden,
                        "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                        "num_attention_heads": heads, "num_key_value_heads": 2,
                        "head_dim": head_dim, "max_position_embeddings": 4096,
                        "shared_expert_intermediate_size": hidden, "initializer_range": 0.1,
                        "rope_parameters": rope, **moe},
        "code_predictor_config": {"vocab_size": CODEBOOK, "hidden_size": hidden,
                                  "intermediate_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": heads, "num_key_value_heads": 2,
                                  "head_dim": head_dim, "num_code_groups": QUANTIZERS,
                                  "initializer_range": 0.1},
        "num_code_groups": QUANTIZERS, "thinker_hidden_size": hidden, "accept_hidden_layer": 1,
        "audio_token_id": ID["<|audio_pad|>"], "image_token_id": ID["<|image_pad|>"],
        "video_token_id": ID["<|video_pad|>"], "audio_start_token_id": ID["<|audio_start|>"],
        "vision_start_token_id": ID["<|vision_start|>"], "spatial_merge_size": 2,
        "speaker_id": SPEAKERS, "initializer_range": 0.1, **CODEC,
    }
    code2wav = {"codebook_size": CODEBOOK, "hidden_size": hidden, "num_attention_heads": heads,
                "num_key_value_heads": heads, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_quantizers": QUANTIZERS, "upsample_rates": [2, 2], "upsampling_ratios": [2],
                "decoder_dim": 32, "sliding_window": 8, "initializer_range": 0.1}
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        im_start_token_id=ID["<|im_start|>"], im_end_token_id=ID["<|im_end|>"],
        tts_pad_token_id=ID["<tts_pad>"], tts_bos_token_id=ID["<tts_text_bos>"],
        tts_eos_token_id=ID["<tts_text_eod>"], system_token_id=-1, user_token_id=-1,
        assistant_token_id=-1)


def save_omni_checkpoint(directory: Path, seed: int = 0, hidden: int = 32,
                         layers: int = 2, *, vision: dict[str, Any] | None = None,
                         max_pixels: int = 64 * 64) -> Path:
    """A tiny random Qwen3-Omni (about 0.5 M parameters) and its processor in `directory`;
    `vision` and `max_pixels` make its vision tower and the images it takes larger."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tokenizer = save_processor(directory, max_pixels)
    config = omni_config(len(tokenizer), hidden, layers, vision)
    roles = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(role)
             for role in ("system", "user", "assistant")}
    for key, value in roles.items():
        setattr(config, key, value)
    config.thinker_config.user_token_id = roles["user_token_id"]
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    draw_experts(model, 0.1)  # left empty or zero by _init_weights
    model.save_pretrained(directory)
    return directory


def hf_processor(directory: Path) -> Any:
    """transformers' own Qwen3OmniMoeProcessor over the saved parts, without a video processor
    (its constructor insists on one, which needs torchvision): the oracle's preprocessing."""
    from transformers import (
        AutoTokenizer,
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    processor = object.__new__(Qwen3OmniMoeProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    processor.feature_extractor = WhisperFeatureExtractor.from_pretrained(directory)
    processor.tokenizer = AutoTokenizer.from_pretrained(directory)
    processor.video_processor = None
    processor.chat_template = processor.tokenizer.chat_template
    for name in ("image_token", "audio_token", "video_token", "image_token_id",
                 "audio_token_id", "video_token_id", "vision_bos_token", "vision_eos_token",
                 "audio_bos_token", "audio_eos_token"):
        setattr(processor, name, getattr(processor.tokenizer, name))
    return processor


def hf_inputs(processor: Any, messages: list[dict[str, Any]], images: list[Any],
              audio: list[Any]) -> Any:
    """transformers' processor on the rendered conversation and its media."""
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=False)
    media: dict[str, Any] = {}
    if images:
        media["images"] = images
    if audio:
        media["audio"] = audio
    return processor(text=[text], return_tensors="pt", **media)


def hf_thinker_tokens(model: Any, processor: Any, messages: list[dict[str, Any]],
                      images: list[Any], audio: list[Any], max_new_tokens: int) -> list[int]:
    """transformers: the processor on the rendered conversation and its media, then
    `generate(return_audio=False)` with a greedy thinker that ignores EOS: the new ids."""
    inputs = hf_inputs(processor, messages, images, audio)
    with torch.inference_mode():
        out = model.generate(**inputs, return_audio=False, thinker_do_sample=False,
                             thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_model(directory: Path) -> Any:
    """transformers' model of the checkpoint (float32, eval), its talker able to lay out
    audio positions: with image and audio together it reads `talker_config.audio_config`,
    which the config lacks (transformers 5.25), so the thinker's is lent to it."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory,
                                                                 dtype=torch.float32).eval()
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model


def hf_speech(model: Any, processor: Any, messages: list[dict[str, Any]], images: list[Any],
              audio: list[Any], thinker_tokens: int, talker_tokens: int,
              talker_min_tokens: int, speaker: str = "Ethan",
              codes: list[torch.Tensor] | None = None) -> tuple[list[int], torch.Tensor]:
    """transformers' `generate(return_audio=True)`, greedy thinker (EOS: <|im_end|>) and
    talker: (the reply's ids, the waveform [S]); the talker's codec frames [Q, N] (what it
    hands code2wav) are appended to `codes` when given."""
    inputs = hf_inputs(processor, messages, images, audio)
    decode = model.code2wav.chunked_decode

    def recorded(frames: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if codes is not None:
            codes.append(frames[0].clone())
        return decode(frames, *args, **kwargs)

    model.code2wav.chunked_decode = recorded
    try:
        # transformers warns that the talker's repetition penalty sees only the codec tokens
        # it generates: what `generate(return_audio=True)` does, and what Omni matches
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Passing `repetition_penalty`", UserWarning)
            sequences, wav = model.generate(
                **inputs, return_audio=True, thinker_do_sample=False,
                thinker_max_new_tokens=thinker_tokens, thinker_eos_token_id=ID["<|im_end|>"],
                talker_do_sample=False, talker_max_new_tokens=talker_tokens,
                talker_min_new_tokens=talker_min_tokens, speaker=speaker)
    finally:
        del model.code2wav.chunked_decode  # the class's own again
    return sequences[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1)
