"""Qwen3-Omni's speech: the talker (a MoE decoder over codec tokens), its code predictor (the
residual codebooks of each codec frame) and code2wav (codec frames to a 24 kHz waveform).

The talker and the code predictor are `DecoderLM`s (the talker: Qwen3-MoE with M-RoPE and a
shared expert on every layer; the predictor: a dense Qwen3 with one embedding and one head per
residual codebook); code2wav and the two projections from the thinker's width are
transformers' own modules. What the talker reads is built as transformers'
`Qwen3OmniMoeForConditionalGeneration.generate` builds it:

- every user turn of the conversation: its text tokens' thinker embeddings through
  `text_projection`, its image and audio positions' thinker hidden states (after layer
  `accept_hidden_layer`) through `hidden_projection`;
- the assistant turn's opening (`<|im_start|>assistant\\n`), four `<tts_pad>`, `<tts_text_bos>`
  and the reply's first token, each text position plus a codec control embedding (no
  thinking, the speaker, codec pad, codec bos);
- then one step per codec frame: the frame's codes embedded and summed, plus the next reply
  token's projected embedding (`<tts_text_eod>` after the last, `<tts_pad>` after that).

Data dependencies, hence streaming: talker step t reads reply token t + 1, so it can run as
soon as the thinker has produced that token; code2wav is causal and decodes frames in chunks.
Running the steps (sampling, the KV, code2wav in chunks) is `omni.compute.talker`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from omni.compute.models._safetensors import read_json, read_tensors
from omni.compute.models.config import qwen3_omni_part
from omni.compute.models.loader import load_decoder
from omni.compute.models.qwen3_omni._modules import load_config, load_module
from omni.compute.models.qwen3_omni.thinker import MediaLayout, mrope_positions

__all__ = ["CHUNK", "LEFT_CONTEXT", "SAMPLE_RATE", "SUPPRESSED", "Qwen3OmniTalker",
           "TalkerPrompt", "ThinkerContext"]

SAMPLE_RATE = 24_000  # code2wav's output rate
SUPPRESSED = 1024  # transformers suppresses the talker's top 1,024 ids (but codec EOS)
CHUNK, LEFT_CONTEXT = 300, 25  # code2wav frames per decode and of left context (transformers')


@dataclass(frozen=True)
class ThinkerContext:
    """What the talker reads of the thinker's prompt (a stage value: the talker may run
    in another process than the thinker): the prompt's ids, where its media are, and per
    position the thinker's input embedding (text) or its hidden state after layer
    `accept_hidden_layer` (media) [T, E]; and the thinker's input embeddings of
    `<tts_text_bos>`, `<tts_text_eod>` and `<tts_pad>` [3, E]; and the request's cache
    salt, which the talker's page keys carry as the thinker's do."""

    token_ids: tuple[int, ...]
    media: tuple[MediaLayout, ...]
    inputs: Tensor
    specials: Tensor
    cache_salt: str = ""


@dataclass(frozen=True)
class TalkerPrompt:
    """What the talker reads before its first step: its prompt's embeddings [L, E] and M-RoPE
    positions [3, L]; and what it adds to later steps' inputs: the projected `<tts_pad>` and
    `<tts_text_eod>` [E], and reply tokens' embeddings through `text_projection`
    (`project`)."""

    embeds: Tensor
    positions: Tensor
    first: int  # the reply's first token
    pad: Tensor
    eos: Tensor
    project: Any  # a reply token's thinker embedding [E] -> what a step adds [E]
    # what names the prompt's KV pages: per position the thinker token it projects (the user
    # turns') or <tts_pad> (the assistant's opening), and the spans whose rows the ids alone
    # do not determine (media hidden states, the opening with its voice and first token)
    ids: tuple[int, ...] = ()
    content_spans: tuple[tuple[int, int], ...] = ()


class Qwen3OmniTalker:
    """The talker, code predictor and code2wav of a Qwen3-Omni checkpoint directory.

    Raises:
        FileNotFoundError, ValueError: as `load_pretrained` (weights that do not fit, ...).
    """

    def __init__(self, root: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        root = Path(root)
        hf_json = read_json(root / "config.json")
        config = load_config(root)
        self.config, self.talker_hf = config, config.talker_config
        self.dtype, self.device = dtype, torch.device(device)
        self.decoder_config = qwen3_omni_part(hf_json, "talker")
        self.decoder = load_decoder(
            root, self.decoder_config, "talker.",
            ("model.layers.", "model.norm.", "model.codec_embedding.", "codec_head."),
            {"model.embed_tokens.weight": "model.codec_embedding.weight",
             "lm_head.weight": "codec_head.weight"}, dtype=dtype, device=device)
        self.predictor = load_decoder(
            root, qwen3_omni_part(hf_json, "code_predictor"), "talker.code_predictor.",
            ("model.layers.", "model.norm.", "model.codec_embedding.0.", "lm_head.0."),
            {"model.embed_tokens.weight": "model.codec_embedding.0.weight",
             "lm_head.weight": "lm_head.0.weight"}, dtype=dtype, device=device)
        groups = self.talker_hf.num_code_groups - 1
        cp = read_tensors(root, "talker.code_predictor.", dtype, device)
        self.group_embeds = [cp[f"model.codec_embedding.{g}.weight"] for g in range(groups)]
        self.group_heads = [cp[f"lm_head.{g}.weight"] for g in range(groups)]
        self.text_projection = load_module(hf.Qwen3OmniMoeTalkerResizeMLP, self.talker_hf, root,
                                           "talker.text_projection.", dtype, self.device)
        self.hidden_projection = load_module(hf.Qwen3OmniMoeTalkerResizeMLP, self.talker_hf,
                                             root, "talker.hidden_projection.", dtype,
                                             self.device)
        self.code2wav = load_module(hf.Qwen3OmniMoeCode2Wav, config.code2wav_config, root,
                                    "code2wav.", dtype, self.device)

    # -- the talker's prompt ----------------------------------------------------------------

    def speaker_id(self, voice: str | None) -> int:
        """The codec id of a voice (case-insensitive; None: transformers' default, Ethan)."""
        speakers = {str(k).lower(): int(v) for k, v in (self.talker_hf.speaker_id or {}).items()}
        name = (voice or "ethan").lower()
        if name not in speakers:
            raise ValueError(f"unknown voice {voice!r}; this checkpoint speaks with "
                             f"{', '.join(sorted(speakers)) or 'no voice'}")
        return speakers[name]

    @torch.inference_mode()
    def prompt(self, context: ThinkerContext, first: int, first_embed: Tensor,
               voice: str | None) -> TalkerPrompt:
        """What the talker reads for the thinker's prompt `context` whose reply starts with
        token `first` (its thinker embedding `first_embed` [E])."""
        ids = context.token_ids
        user = self._user_positions(ids)
        media_at = {p for item in context.media for p in range(item.start,
                                                                  item.start + item.length)}
        inputs = context.inputs.to(self.device, self.dtype)
        # as transformers: every text position through `text_projection` at once, every
        # media position through `hidden_projection` at once
        is_media = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        is_media[sorted(media_at)] = True
        projected = torch.empty(len(ids), self.decoder_config.hidden_size, device=self.device,
                                dtype=self.dtype)
        projected[~is_media] = self.text_projection(inputs[~is_media])
        if media_at:
            projected[is_media] = self.hidden_projection(inputs[is_media])
        user_embeds = projected[user]
        start = self._assistant_start(ids)
        assistant = torch.cat([projected[start:start + 3], self.text_projection(
            first_embed.to(self.device, self.dtype))[None]])
        bos, eos, pad = self.text_projection(context.specials.to(self.device, self.dtype))
        talker = self.talker_hf
        codec = self.decoder.embed(torch.tensor(
            [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
             self.speaker_id(voice), talker.codec_pad_id, talker.codec_bos_id],
            device=self.device))
        text_part = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        codec_part = torch.cat([torch.zeros_like(codec[:3]), codec])
        embeds = torch.cat([user_embeds, text_part + codec_part])
        positions = self._positions(context, user, len(embeds)).to(self.device)
        index = {p: i for i, p in enumerate(user)}
        spans = [(index[item.start], item.length) for item in context.media
                 if item.start in index]
        spans.append((len(user), len(embeds) - len(user)))
        talker_ids = (tuple(ids[p] for p in user)
                      + (int(self.config.tts_pad_token_id),) * (len(embeds) - len(user)))
        return TalkerPrompt(embeds, positions, first, pad, eos, lambda embed: (
            self.text_projection(embed.to(self.device, self.dtype))), talker_ids, tuple(spans))

    def _user_positions(self, ids: tuple[int, ...]) -> list[int]:
        """The prompt positions in user turns: each token's role is the token after the last
        `<|im_start|>` at or before it (as transformers finds it)."""
        start_id, user_id = self.config.im_start_token_id, self.config.user_token_id
        last, out = 0, []
        for p, token in enumerate(ids):
            if token == start_id:
                last = p
            if ids[min(last + 1, len(ids) - 1)] == user_id:
                out.append(p)
        return out

    def _assistant_start(self, ids: tuple[int, ...]) -> int:
        start_id, assistant_id = self.config.im_start_token_id, self.config.assistant_token_id
        starts = [p for p in range(len(ids) - 1)
                  if ids[p] == start_id and ids[p + 1] == assistant_id]
        if not starts:
            raise ValueError("the talker needs the prompt to open an assistant turn "
                             "(<|im_start|>assistant)")
        return starts[-1]

    def _positions(self, context: ThinkerContext, user: list[int], length: int) -> Tensor:
        """M-RoPE positions of the talker's prompt: its user tokens' media laid out as the
        thinker lays them out, everything else text."""
        index = {p: i for i, p in enumerate(user)}
        media = [MediaLayout(index[item.start], item.length, item.grid)
                 for item in context.media if item.start in index]
        return mrope_positions(length, media, int(self.talker_hf.spatial_merge_size),
                               float(self.talker_hf.position_id_per_seconds))

    # -- a step ---------------------------------------------------------------------------

    def frames(self, talker_hidden: Tensor, tokens: list[int],
               pick: Any) -> tuple[list[list[int]], Tensor]:
        """The frames of B codec tokens at once: each token's residual codes from the code
        predictor (drawn by `pick(logits [B, V]) -> B ids`, a codebook at a time) after the
        talker's hidden state that chose it (`talker_hidden` [B, E]); and each frame's input
        embedding for the talker's next step [B, E] (every codebook's embedding summed).
        Every row's sequence is as long as the others': no mask, shared positions."""
        ids = torch.tensor(tokens, device=self.device)[:, None]
        first = self.decoder.embed(ids)  # [B, 1, E]
        x = torch.cat([talker_hidden[:, None], first], dim=1)
        codes = [[token] for token in tokens]
        total = first[:, 0]
        past = None
        start = 0
        for group, head in enumerate(self.group_heads):
            pos = torch.arange(start, start + x.shape[1], device=self.device)
            hidden, new_kv = self.predictor.forward(x, pos.expand(len(tokens), -1), past)
            past = new_kv if past is None else [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(past, new_kv, strict=True)]
            start += x.shape[1]
            picked = pick(F.linear(hidden[:, -1], head).float())
            for row, code in zip(codes, picked, strict=True):
                row.append(int(code))
            embedded = self.group_embeds[group][torch.tensor(picked, device=self.device)]
            total = total + embedded
            x = embedded[:, None]
        return codes, total
