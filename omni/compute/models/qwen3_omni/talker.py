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

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from omni.compute.models._safetensors import read_json, read_tensors
from omni.compute.models.config import qwen3_omni_part
from omni.compute.models.loader import load_decoder
from omni.compute.models.qwen3_omni._modules import load_config, load_module
from omni.compute.models.qwen3_omni.thinker import MediaLayout, mrope_positions
from omni.compute.sampling import (
    RequestSamplingState,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
)

__all__ = ["Code2WavStream", "Qwen3OmniTalker", "TalkerPrompt", "TalkerRun", "ThinkerContext",
           "talker_params"]

SAMPLE_RATE = 24_000  # code2wav's output rate
SUPPRESSED = 1024  # transformers suppresses the talker's top 1,024 ids (but codec EOS)
CHUNK, LEFT_CONTEXT = 300, 25  # code2wav frames per decode and of left context (transformers')


@dataclass(frozen=True)
class ThinkerContext:
    """What the talker reads of the thinker's prompt (a stage value: the talker may run
    in another process than the thinker): the prompt's ids, where its media are, and per
    position the thinker's input embedding (text) or its hidden state after layer
    `accept_hidden_layer` (media) [T, E]; and the thinker's input embeddings of
    `<tts_text_bos>`, `<tts_text_eod>` and `<tts_pad>` [3, E]."""

    token_ids: tuple[int, ...]
    media: tuple[MediaLayout, ...]
    inputs: Tensor
    specials: Tensor


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


def talker_params(**fields: Any) -> SamplingParams:
    """The talker's sampling: transformers' defaults of `generate(return_audio=True)`
    (temperature 0.9, top-k 50, repetition penalty 1.05 over the codec tokens so far, at
    most 4,096 codec tokens) with `fields` (SGLang's `SamplingParams` names) over them."""
    defaults = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
                "max_new_tokens": 4096}
    return SamplingParams(**{**defaults, **fields})


class _SuppressControls:
    """transformers suppresses the talker's top 1,024 ids (its control codes) but codec EOS
    (a logit processor, in SGLang's terms)."""

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, logits: Tensor, custom_param_list: list[Any]) -> Tensor:
        keep = logits[:, self.eos].clone()
        logits[:, max(0, logits.shape[-1] - SUPPRESSED):] = float("-inf")
        logits[:, self.eos] = keep
        return logits


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
        texts = self.text_projection(inputs)  # every position: the media rows go unused
        rows = [self.hidden_projection(inputs[p]) if p in media_at else texts[p] for p in user]
        user_embeds = (torch.stack(rows) if rows
                       else torch.empty(0, self.decoder_config.hidden_size, device=self.device))
        start = self._assistant_start(ids)
        assistant = torch.cat([texts[start:start + 3], self.text_projection(
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
        return TalkerPrompt(embeds, positions, first, pad, eos, lambda embed: (
            self.text_projection(embed.to(self.device, self.dtype))))

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

    # -- generation -------------------------------------------------------------------------

    def start(self, prompt: TalkerPrompt, eos_ids: tuple[int, ...],
              sampling: SamplingParams) -> TalkerRun:
        """Prefill the talker on `prompt`: a `TalkerRun` that speaks as the reply's tokens
        are fed to it (`eos_ids`: the thinker's, which end a reply)."""
        return TalkerRun(self, prompt, eos_ids, sampling)

    def _frame(self, talker_hidden: Tensor, token: int,
               pick: Any) -> tuple[list[int], Tensor]:
        """The residual codes of a codec token from the code predictor (each drawn by
        `pick(logits [V]) -> id`), and the frame's input embedding for the talker's next step
        (every codebook's embedding summed)."""
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
            code = pick(F.linear(hidden[0, -1], head).float())
            codes.append(code)
            embedded = self.group_embeds[group][code]
            total = total + embedded
            x = embedded[None, None]
        return codes, total


class TalkerRun:
    """One reply being spoken, step by step: each step turns the current codec token into a
    frame (its residual codes from the code predictor) and feeds the frame, plus the reply's
    next projected token, back to the talker for the next codec token.

    Step k adds reply token k + 1 (`<tts_text_eod>` in place of the reply's last token,
    `<tts_pad>` after it), so it can run once the thinker has given token k + 2 or ended:
    `feed` the reply's tokens after the first as they come, `end` when it is complete, and
    call `step` while `ready`.
    """

    def __init__(self, talker: Qwen3OmniTalker, prompt: TalkerPrompt, eos_ids: tuple[int, ...],
                 sampling: SamplingParams):
        self.talker, self.prompt, self.sampling = talker, prompt, sampling
        self.eos_ids = frozenset(eos_ids)
        codec_eos = int(talker.talker_hf.codec_eos_token_id)
        self.max_new_tokens = (sampling.max_new_tokens
                               or talker.decoder_config.max_position_embeddings)
        self._sampler = TokenSampler()
        self._state = TokenSamplingState([RequestSamplingState(
            sampling, eos_token_ids=(codec_eos,), logit_processor=_SuppressControls(codec_eos),
            vocab_size=talker.decoder_config.vocab_size)])
        # the code predictor samples when the talker does, as transformers lets it (top-k 50,
        # top-p 0.8), from a generator of its own
        predictor = (SamplingParams(temperature=0) if sampling.is_greedy else SamplingParams(
            top_k=50, top_p=0.8, sampling_seed=None if sampling.sampling_seed is None
            else sampling.sampling_seed + 1))
        self._predictor_state = RequestSamplingState(predictor)
        self.reply: list[int] = [prompt.first]  # its projection is in the prompt already
        self.embeds: list[Tensor | None] = [None]  # the reply tokens' thinker embeddings
        self.ended = False
        self.generated: list[int] = []  # the talker's codec tokens
        with torch.inference_mode():
            hidden, self.past = talker.decoder.forward(prompt.embeds[None],
                                                       prompt.positions[:, None])
        self.length = len(prompt.embeds)
        self.offset = int(prompt.positions.max()) + 1 - self.length
        self.hidden = hidden[:, -1:]
        self._sample()

    def feed(self, token: int, embed: Tensor) -> None:
        """The reply's next token (the second on: the first is in the prompt) and its thinker
        input embedding [E]."""
        if self.ended:
            raise RuntimeError("the reply has ended")
        self.reply.append(int(token))
        self.embeds.append(embed)

    def end(self) -> None:
        """The reply is complete."""
        self.ended = True

    @property
    def done(self) -> bool:
        """Whether the talker has stopped (codec EOS, or `max_new_tokens`)."""
        return (self.generated[-1] == self.talker.talker_hf.codec_eos_token_id
                or len(self.generated) >= self.max_new_tokens)

    @property
    def ready(self) -> bool:
        """Whether `step` can run now (not done, and the reply's text it adds is known)."""
        return not self.done and self._text(len(self.generated) - 1) is not None

    @torch.inference_mode()
    def step(self) -> list[int]:
        """The current codec token's frame [Q codes]; the talker then reads it and picks the
        next codec token. RuntimeError unless `ready`."""
        k = len(self.generated) - 1
        text = self._text(k)
        if self.done or text is None:
            raise RuntimeError("the talker cannot step now (see TalkerRun.ready)")
        frame, frame_embed = self.talker._frame(self.hidden, self.generated[-1],
                                                self._pick_residual)
        position = torch.full((1, 1), self.length + k + self.offset,
                              device=self.talker.device)
        self.hidden, new_kv = self.talker.decoder.forward((frame_embed + text)[None, None],
                                                          position, self.past)
        self.past = [(torch.cat([k_, nk], dim=2), torch.cat([v_, nv], dim=2))
                     for (k_, v_), (nk, nv) in zip(self.past, new_kv, strict=True)]
        self._sample()
        return frame

    def _sample(self) -> None:
        logits = self.talker.decoder.logits(self.hidden[:, -1])  # [1, V]
        self.generated.append(int(self._sampler.step(logits, self._state)[0]))

    def _pick_residual(self, logits: Tensor) -> int:
        """A residual code from the code predictor's logits [V] (a fresh one-row batch each
        time: its penalties, none, need no history)."""
        state = TokenSamplingState([self._predictor_state])
        return int(self._sampler.step(logits[None], state)[0])

    def _text(self, j: int) -> Tensor | None:
        """What step j adds, as transformers lays out `trailing_text_hidden`: the projected
        reply token j + 1, `<tts_text_eod>` in place of the reply's last token (and at its
        first end-of-sequence token, should one come earlier), `<tts_pad>` past either; None
        while unknown (reply token j + 1, and whether it is the last, are not known yet)."""
        known = len(self.reply)
        if not self.ended and known < j + 3:
            return None
        if self.ended and j >= known - 1:
            return self.prompt.pad
        eos_at = next((i for i, t in enumerate(self.reply) if t in self.eos_ids), None)
        if eos_at is not None and j >= eos_at:
            return self.prompt.eos if j == eos_at else self.prompt.pad
        if self.ended and j == known - 2:
            return self.prompt.eos
        return self.prompt.project(self.embeds[j + 1])


class Code2WavStream:
    """code2wav as frames arrive: the samples transformers' `chunked_decode` gives (chunks of
    300 frames, 25 frames of left context), sent early. code2wav is causal, so decoding a
    chunk's first n frames gives the first samples of decoding all of them; a chunk is
    decoded again at 1, 2, 4, ... of its frames (and at its end), and each time the samples
    not sent yet go out (up to float rounding, ~1e-6, the same samples)."""

    def __init__(self, code2wav: Any, first: int = 1):
        self.code2wav, self.first = code2wav, first
        self.upsample = int(code2wav.total_upsample)
        self.device = next(code2wav.parameters()).device
        self.frames: list[list[int]] = []
        self.chunk_start = 0  # the first frame of the current chunk
        self.sent = 0  # samples of the current chunk sent
        self.next_at = first  # frames of the chunk at which it is decoded next

    def push(self, frame: list[int]) -> np.ndarray:
        """Take a frame; the samples it makes ready (often none)."""
        self.frames.append(frame)
        in_chunk = len(self.frames) - self.chunk_start
        if in_chunk < self.next_at and in_chunk < CHUNK:
            return np.zeros(0, np.float32)
        out = self._decode()
        self.next_at = min(2 * in_chunk, CHUNK)
        if in_chunk == CHUNK:  # the next chunk starts, with its left context
            self.chunk_start, self.sent, self.next_at = len(self.frames), 0, self.first
        return out

    def finish(self) -> np.ndarray:
        """The remaining samples (the last frames' tail)."""
        if len(self.frames) == self.chunk_start:
            return np.zeros(0, np.float32)
        return self._decode()

    @torch.inference_mode()
    def _decode(self) -> np.ndarray:
        context = min(LEFT_CONTEXT, self.chunk_start)
        codes = torch.tensor(self.frames[self.chunk_start - context:],
                             device=self.device).T[None]
        wav = self.code2wav(codes)[0, 0, context * self.upsample:].float().cpu().numpy()
        out, self.sent = wav[self.sent:], len(wav)
        return out
