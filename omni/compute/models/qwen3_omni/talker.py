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
from omni.compute.models.qwen3_omni._modules import load_module
from omni.compute.models.qwen3_omni.thinker import mrope_positions
from omni.compute.prompt import MediaItem, PromptTokens

__all__ = ["Qwen3OmniTalker", "TalkerPrompt", "TalkerSampling"]

SAMPLE_RATE = 24_000  # code2wav's output rate
SUPPRESSED = 1024  # transformers suppresses the talker's top 1,024 ids (but codec EOS)
CHUNK, LEFT_CONTEXT = 300, 25  # code2wav frames per decode and of left context (transformers')


@dataclass(frozen=True)
class TalkerPrompt:
    """What the talker reads: its prompt's embeddings [L, E] and M-RoPE positions [3, L],
    the reply's projected embeddings [R, E] its steps add one by one, and what they add
    after those (`<tts_pad>`'s, [E])."""

    embeds: Tensor
    positions: Tensor
    trailing: Tensor
    pad: Tensor


@dataclass(frozen=True)
class TalkerSampling:
    """How the talker picks codec tokens: greedy, with transformers' defaults of
    `generate(return_audio=True)` for the rest (repetition penalty 1.05 over the codec tokens
    so far; at least `min_new_tokens` before codec EOS may end it)."""

    max_new_tokens: int = 4096
    min_new_tokens: int = 0
    repetition_penalty: float = 1.05


class Qwen3OmniTalker:
    """The talker, code predictor and code2wav of a Qwen3-Omni checkpoint directory.

    Raises:
        FileNotFoundError, ValueError: as `load_pretrained` (weights that do not fit, ...).
    """

    def __init__(self, root: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        root = Path(root)
        hf_json = read_json(root / "config.json")
        config = Qwen3OmniMoeConfig.from_pretrained(root)
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
    def prompt(self, tokens: PromptTokens, reply: list[int], embed: Any,
               media_hidden: dict[int, Tensor], media: Any, voice: str | None,
               eos_ids: tuple[int, ...]) -> TalkerPrompt:
        """What the talker reads for a conversation `tokens` whose reply the thinker gave as
        `reply` (at least one token). `embed` maps token ids to the thinker's input
        embeddings; `media_hidden[p]` is the thinker's hidden state at media position p after
        layer `accept_hidden_layer`; `media` (the thinker's `Qwen3OmniMedia`) lays out images."""
        cfg = self.config
        ids = torch.tensor(tokens.token_ids, device=self.device)
        user = self._user_positions(tokens.token_ids)
        media_at = {p for item in tokens.media for p in range(item.start,
                                                                 item.start + item.length)}
        rows = []
        for p in user:
            if p in media_at:
                rows.append(self.hidden_projection(media_hidden[p].to(self.dtype)))
            else:
                rows.append(self.text_projection(embed(ids[p:p + 1])[0].to(self.dtype)))
        user_embeds = (torch.stack(rows) if rows
                       else torch.empty(0, self.decoder_config.hidden_size, device=self.device))
        start = self._assistant_start(tokens.token_ids)
        sequence = torch.tensor(list(tokens.token_ids) + list(reply), device=self.device)
        assistant = self.text_projection(embed(sequence[start:-1]).to(self.dtype))
        bos, eos, pad = self.text_projection(embed(torch.tensor(
            [cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id],
            device=self.device)).to(self.dtype))
        talker = self.talker_hf
        codec = self.decoder.embed(torch.tensor(
            [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
             self.speaker_id(voice), talker.codec_pad_id, talker.codec_bos_id],
            device=self.device))
        text_part = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        codec_part = torch.cat([torch.zeros_like(codec[:3]), codec])
        embeds = torch.cat([user_embeds, text_part + codec_part])
        trailing = torch.cat([assistant[4:], eos[None]])
        first_eos = next((i for i, t in enumerate(reply) if t in eos_ids), len(reply))
        if first_eos < len(trailing):
            trailing[first_eos] = eos
            trailing[first_eos + 1:] = pad
        positions = self._positions(tokens, user, len(embeds), media)
        return TalkerPrompt(embeds, positions, trailing, pad)

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

    def _positions(self, tokens: PromptTokens, user: list[int], length: int,
                   media: Any) -> Tensor:
        """M-RoPE positions of the talker's prompt: its user tokens' media laid out as the
        thinker lays them out, everything else text."""
        index = {p: i for i, p in enumerate(user)}
        items = tuple(MediaItem(item.kind, index[item.start], item.length, item.segment)
                      for item in tokens.media if item.start in index)
        ids = tuple(tokens.token_ids[p] for p in user)
        shifted = PromptTokens(ids + (self.config.tts_pad_token_id,) * (length - len(ids)),
                               items)
        grids = {id(item): media.grid(item.segment) for item in items if item.kind == "image"}
        return mrope_positions(shifted, grids, int(self.talker_hf.spatial_merge_size),
                               float(self.talker_hf.position_id_per_seconds))

    # -- generation -------------------------------------------------------------------------

    @torch.inference_mode()
    def codes(self, prompt: TalkerPrompt, sampling: TalkerSampling) -> Tensor:
        """The codec frames [Q, N] of one reply, decoded greedily (see `TalkerSampling`);
        the last codec token (EOS, or the one at `max_new_tokens`) makes no frame, as in
        transformers."""
        length, trailing = len(prompt.embeds), prompt.trailing
        hidden, past = self.decoder.forward(prompt.embeds[None], prompt.positions[:, None])
        offset = int(prompt.positions.max()) + 1 - length
        generated: list[int] = []
        frames: list[list[int]] = []
        last_hidden = hidden[:, -1:]
        while True:
            token = self._pick(self.decoder.logits(last_hidden[:, -1])[0], generated, sampling)
            generated.append(token)
            if token == self.talker_hf.codec_eos_token_id or len(generated) >= \
                    sampling.max_new_tokens:
                break
            step = len(generated) - 1
            frame, frame_embed = self._frame(last_hidden, token)
            frames.append(frame)
            x = frame_embed + (trailing[step] if step < len(trailing) else prompt.pad)
            pos = torch.full((1, 1), length + step + offset, device=self.device)
            last_hidden, new_kv = self.decoder.forward(x[None, None], pos, past)
            past = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                    for (k, v), (nk, nv) in zip(past, new_kv, strict=True)]
        if not frames:
            return torch.empty(self.talker_hf.num_code_groups, 0, dtype=torch.long)
        return torch.tensor(frames, dtype=torch.long).T

    def _pick(self, logits: Tensor, generated: list[int], sampling: TalkerSampling) -> int:
        """transformers' logits processors for the talker, then the argmax."""
        scores = logits.float().clone()
        if generated and sampling.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(generated)), device=scores.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * sampling.repetition_penalty,
                                       picked / sampling.repetition_penalty)
        vocab, eos = scores.numel(), self.talker_hf.codec_eos_token_id
        keep = scores[eos].clone()
        scores[max(0, vocab - SUPPRESSED):] = float("-inf")
        scores[eos] = keep
        if len(generated) < sampling.min_new_tokens:
            scores[eos] = float("-inf")
        return int(scores.argmax())

    def _frame(self, talker_hidden: Tensor, token: int) -> tuple[list[int], Tensor]:
        """The residual codes of a codec token from the code predictor (greedy), and the
        frame's input embedding for the talker's next step (every codebook's embedding
        summed)."""
        first = self.decoder.embed(torch.tensor([[token]], device=self.device))  # [1, 1, E]
        x = torch.cat([talker_hidden[:, -1:], first], dim=1)
        codes, total = [token], first[0, 0]
        past = None
        start = 0
        for group, head in enumerate(self.group_heads):
            pos = torch.arange(start, start + x.shape[1], device=self.device)[None]
            hidden, new_kv = self.predictor.forward(x, pos, past)
            past = new_kv if past is None else [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(past, new_kv, strict=True)]
            start += x.shape[1]
            code = int(F.linear(hidden[0, -1], head).float().argmax())
            codes.append(code)
            embedded = self.group_embeds[group][code]
            total = total + embedded
            x = embedded[None, None]
        return codes, total

    @torch.inference_mode()
    def waveform(self, codes: Tensor) -> Tensor:
        """code2wav on frames [Q, N]: float samples [S] at 24 kHz, in chunks of 300 frames
        with 25 frames of left context, as transformers decodes them."""
        if codes.shape[1] == 0:
            return torch.zeros(0)
        wav = self.code2wav.chunked_decode(codes[None].to(self.device), chunk_size=CHUNK,
                                           left_context_size=LEFT_CONTEXT)
        return wav.reshape(-1).float().cpu()
