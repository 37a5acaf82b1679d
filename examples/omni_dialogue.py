"""Omni dialogue: speech and images in, an LLM's streamed reply spoken out, sessions cached.

    omni run examples/omni_dialogue.py --inputs-json examples/dialogue_turns.jsonl --json
    omni run examples/omni_dialogue.py --inputs-json examples/dialogue_turns.jsonl --json \\
        --kv-device 80KiB --kv-disk 16MiB:/tmp/omni-kv    # idle sessions go to disk and back
    omni graph show examples/omni_dialogue.py --format mermaid
    omni serve examples/omni_dialogue.py --port 8000    # OpenAI's /v1/chat/completions

One request is one turn of a conversation: ``{"session": "alice", "text": "Hi!"}`` plus,
optionally, ``"audio"`` (a 16 kHz mono 16-bit WAV file), ``"image"`` (PNG, JPEG or a ``.npy``
``[H, W, 3]`` array), ``"out"`` (where to write the spoken reply) and ``"max_tokens"`` (32).
Paths are relative to the current folder. The reply's WAV goes to ``out``, by default
``<session>-<turn>.wav`` in ``$OMNI_DIALOGUE_OUT`` (the current folder when unset). The graph
marks them as files (`omni.InputFile`, `omni.OutputFile`): served by ``omni serve``, a client
may name ``audio`` and ``image`` only under a folder the operator allows (``--allow-path``),
and the server picks ``out`` itself and sends the WAV back in the answer's ``"files"``.

    begin ─┐
    hear ──┼─► Dialogue ─────────► Speech ──────────────► write_reply ─► the turn's result
    look ──┘   (LLM: streams       (streams an audio       (writes the WAV
                the reply tokens)   chunk per 4 tokens)     as chunks come)

- `hear` and `look` read the files (in worker threads); the engine's built-in audio and image
  encoders turn them into embeddings at placeholder positions during prefill, and each
  item's content digest enters the KV page keys.
- `Dialogue` keeps each session's history (the prompt segments and the reply tokens exactly
  as generated), so turn k's prompt starts with turn k-1's prompt and reply: their KV pages
  are found in the runtime's KV store (`omni.context().kv`; in a runtime without one, in
  the engine's own default store) and only the new message is computed. As the tiers fill
  (``--kv-*``), pages of idle sessions move down to host memory or disk, and come back up
  when the session speaks again. The top tier must hold a session's whole history at once,
  or that turn recomputes it (the tiny model's pages are 8 KiB: 80KiB holds 10 pages, 160
  tokens).
- `Dialogue` remembers each tenant's 256 most recently used sessions (an LRU per tenant: a
  tenant opening more evicts only its own older ones, which start over). Served, a tenant is
  an API key (the graph's ``CacheSalt(per="tenant")`` input, which clients cannot set, so
  there are as many as the server has keys); under ``omni run`` there is one.
  A session's history holds its token ids and its images and audio clips (pixels and
  samples: should its pages be gone, the next turn encodes them again), and is cut from the
  oldest turn on when it would outgrow the model's context (`trimmed_turns`).
  It serves one turn at a time (a class node's default), so the turns of a session never
  overlap; ``omni run`` sends one request at a time unless given ``--concurrency``.
- Decoding is greedy: a turn's reply is the same with or without the cache.

The LLM is the built-in tiny random Llama (a byte tokenizer; its replies are gibberish, made
in milliseconds; a run takes a few seconds, most of it importing torch). With
``OMNI_MODEL=/path`` (a Hugging Face Llama or Qwen2 folder: config.json, safetensors and
tokenizer.json) it is that model, loaded with `TorchEngine.from_pretrained`, in float32 on
the CPU; the prompt is then a plain "User: ... Assistant:" transcript, not the model's chat
template. The speech decoder stays the built-in, untrained
`omni.compute.speech.SpeechDecoder` either way: it makes one tone per token, not words; a
real vocoder takes its place through the same `decode_chunk` method. With a Qwen3-Omni folder
as ``OMNI_MODEL`` the LLM is its thinker (audio and images through the checkpoint's own
encoders, rendered by its chat template) and `Speech` is its talker and code2wav
(`omni.compute.talker`): `Dialogue`/`Chat` send the thinker's prompt context with `Started`
and each token's embedding with `Token`, and 24 kHz speech follows the text two tokens
behind. The model is chosen per process, because `omni run` builds the KV store from
`KV_LAYOUT`, the model's page layout, before any request runs.

The file's second graph, `chat`, serves the same LLM and speech decoder to chat clients:
``omni serve examples/omni_dialogue.py`` answers ``POST /v1/chat/completions`` with it
(``model: "chat"``; it is marked with `omni.serve.openai.chat_completions`, and ``omni run``
still picks `dialogue`). A chat client sends the whole conversation every turn, so `chat`
keeps no sessions: `Chat` renders the messages as `Dialogue` renders a session (text, images
and audio clips in place) and the store finds the earlier turns' pages; `to_openai` turns the
events into the endpoint's (text as it decodes, audio chunks when the request asks for
audio, the finish).

Each result reports `cached_tokens` (prompt tokens whose KV came from the store),
`new_tokens` (prompt tokens this turn computed), `ttft_s` and `first_audio_s` (seconds from
the request's start until the first token and the first audio chunk reached `write_reply`),
the WAV's path and length, and `kv`: pages this turn brought up to the top tier
(`promoted`), read back from disk (`from_disk`) and pushed down a tier (`demoted`), from the
store's counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import trio

import omni
from omni.compute import Audio, Image, Prompt, SamplingParams, Text, TorchEngine
from omni.compute.models import DecoderConfig, tiny_config
from omni.compute.models.config import is_qwen3_omni
from omni.compute.prompt import PromptTokens
from omni.compute.speech import SAMPLE_RATE, SpeechDecoder, WavWriter, read_wav
from omni.compute.talker import Talker, reply_embeddings, talker_params, thinker_context
from omni.serve.openai import (
    AudioPart,
    ChatAudio,
    ChatEnd,
    ChatMessage,
    ChatRequest,
    ChatStart,
    ChatText,
    ImagePart,
    chat_completions,
)

MODEL = os.environ.get("OMNI_MODEL", "")  # a Hugging Face folder; "" = the built-in tiny model
PAGE_SIZE = 16
MAX_SESSIONS = 256
TOKENS_PER_CHUNK = 4
MAX_TOKENS_LIMIT = 4096
MAX_TALKER_TOKENS = 4096  # codec tokens of one spoken reply at most (transformers' default)
# unless a request says otherwise, the talker's codec tokens are bounded by the reply's text:
# 8 frames (0.64 s of speech at Qwen3-Omni's 12.5 Hz) per reply token, and 16 more
FRAMES_PER_TOKEN = 8
SYSTEM = "A conversation between a curious user and a helpful assistant.\n"


def llm_config(model: str) -> tuple[DecoderConfig, bool]:
    """The LLM's config, read without loading its weights (for KV_LAYOUT and the vocabulary),
    and whether it is a Qwen3-Omni checkpoint (the thinker; its talker speaks)."""
    if not model:
        return tiny_config(), False
    config = Path(model) / "config.json"
    try:
        hf = json.loads(config.read_text())
        return DecoderConfig.from_hf(hf), is_qwen3_omni(hf)
    except (OSError, ValueError) as exc:
        raise ValueError(f"OMNI_MODEL={model!r}: cannot read {config} ({exc}); give a Hugging "
                         "Face model folder, or unset OMNI_MODEL for the built-in tiny "
                         "model") from None


CONFIG, QWEN3_OMNI = llm_config(MODEL)
KV_LAYOUT = CONFIG.kv_layout(PAGE_SIZE, torch.float32)  # `omni run` builds the store from it
# the spoken reply's rate: Qwen3-Omni's code2wav speaks at 24 kHz, the built-in decoder at 16
SPEECH_RATE = 24_000 if QWEN3_OMNI else SAMPLE_RATE


# -- what flows between the nodes -----------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One request: the session, the new user message and when the request started."""

    session: str
    text: str
    out: str | None
    max_tokens: int
    started: float  # time.perf_counter() when the request entered the graph
    salt: str = ""  # the request's cache salt: sessions and KV pages are its own
    tenant: str = ""  # the tenant's own salt: its sessions count toward its quota


class Event:
    """What the LLM streams to the speech decoder, and the speech decoder to `write_reply`."""


@dataclass(frozen=True)
class Started(Event):
    """The LLM's first event: the turn's number and what its prompt cost."""

    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the store
    trimmed_turns: int  # oldest turns dropped so that the prompt fits the context
    speak: bool = True  # the speech decoder voices this reply
    # Qwen3-Omni: what its talker reads of the prompt (a ThinkerContext), the voice and the
    # talker's sampling fields
    context: Any = None
    voice: str | None = None
    talker: dict | None = None


@dataclass(frozen=True)
class Token(Event):
    """One generated token (and, for a chat client, the text it completes)."""

    id: int
    text: str = ""
    embed: Any = None  # Qwen3-Omni: the token's thinker embedding, which the talker reads


@dataclass(frozen=True)
class AudioChunk(Event):
    """Samples (float32, mono, `SPEECH_RATE`) of a few tokens, in order."""

    samples: np.ndarray


@dataclass(frozen=True)
class Finished(Event):
    """The LLM's last event: the reply and the pages the store moved for this turn."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (an end-of-sequence token) or "length" (max_tokens)
    kv: dict[str, int]
    index: int = 0  # which choice, when a chat request asks for n of them


# -- the nodes ------------------------------------------------------------------------------


@omni.node
async def begin(session: str, text: str, out: str, max_tokens: int, salt: str,
                tenant: str) -> Turn:
    """The entry: check the request and note when it started."""
    started = time.perf_counter()
    if not isinstance(session, str) or not session.strip() or len(session) > 200:
        raise ValueError(f"session must be a non-empty string of at most 200 characters, "
                         f"got {session!r:.60}")
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {text!r:.60}")
    if out is not None and not isinstance(out, str):
        raise ValueError(f"out must be a file path, got {out!r:.60}")
    if (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        raise ValueError(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, "
                         f"got {max_tokens!r}")
    for name, value in (("salt", salt), ("tenant", tenant)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r:.60}")
    return Turn(session, text, out or None, max_tokens, started, salt, tenant)


@omni.node(thread=True)
def hear(audio: str) -> Prompt:
    """A WAV file (16 kHz, mono, 16-bit) as a prompt fragment for the engine's audio encoder
    (an empty one without a file)."""
    if not audio:
        return Prompt()
    samples, rate = read_wav(audio)
    if rate != SAMPLE_RATE:
        raise ValueError(f"{audio}: expected {SAMPLE_RATE} Hz audio, got {rate} Hz (resample "
                         f"it: ffmpeg -i IN -ac 1 -ar {SAMPLE_RATE} OUT.wav)")
    return Prompt(Audio(samples, rate))


@omni.node(thread=True)
def look(image: str) -> Prompt:
    """A PNG/JPEG file or a ``.npy`` ``[H, W, 3]`` array as a prompt fragment for the
    engine's image encoder (an empty one without a file)."""
    if not image:
        return Prompt()
    if not os.path.isfile(image):
        raise ValueError(f"image file not found: {image}")
    try:
        if image.lower().endswith(".npy"):
            return Prompt(Image(np.load(image, allow_pickle=False)))
        return Prompt(Image(image))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{image}: {exc}") from None


@dataclass
class _Session:
    exchanges: list[tuple[list, int]]  # (segments of a message and its reply, their tokens)
    turns: int = 0
    # with a chat template: the conversation as the template takes it, a dict per message
    messages: list[dict[str, str]] = field(default_factory=list)


@omni.node
class Dialogue:
    """The LLM. Keeps the history of each tenant's `max_sessions` most recently used sessions
    and streams a turn's reply token by token, between a `Started` and a `Finished` event."""

    def __init__(self, model: str = MODEL, max_sessions: int = MAX_SESSIONS, seed: int = 0):
        self.engine = _engine(model, seed)
        self.store = self.engine.store
        self.tokenizer = self.engine.tokenizer
        self.max_sessions = max_sessions  # per tenant
        # by tenant, its sessions by (salt, name), least recently used first
        self.sessions: dict[str, OrderedDict[tuple[str, str], _Session]] = {}
        self.system = Text(self.tokenizer.encode(SYSTEM))
        self.templated = has_chat_template(self.engine)

    async def __call__(self, turn: Turn, heard: Prompt, seen: Prompt) -> AsyncIterator[Event]:
        self.engine.check_length(Prompt(turn.text))  # a text too long: refused untokenized
        session = self._session(turn)
        if self.templated:
            media = (heard + seen).segments
            if media and not QWEN3_OMNI:
                raise ValueError(f"{self.engine.model_id} is a text model: its chat template "
                                 "takes no audio or image")
            message: list = []
            session.messages.append({"role": "user", "content": _content(turn.text, media)
                                     if QWEN3_OMNI else turn.text})
            trimmed, prompt, tokens = await self._fit_template(session, turn.max_tokens)
        else:
            message = self._message(turn.text, heard + seen, first=not session.turns)
            trimmed = self._fit(session, message, turn.max_tokens)
            prompt = Prompt([self.system, *(s for segs, _ in session.exchanges for s in segs),
                             *message])
            tokens = self.engine.prepare(prompt)
        before = self._kv_counters()
        number = session.turns + 1
        params = SamplingParams(max_new_tokens=turn.max_tokens, temperature=0)
        # the talker speaks deterministically too, as long as the text allows
        talker = {"temperature": 0, "max_new_tokens": _talker_frames(turn.max_tokens)}
        reply: list[int] = []
        stream = self.engine.stream(prompt, params, cache_salt=turn.salt)
        # Closed even when the turn is cancelled while this generator waits at a `yield`:
        # otherwise the engine would go on decoding the abandoned reply (a batch row, compute
        # and pages) until the garbage collector finalized the stream.
        async with contextlib.aclosing(stream):
            async for token_id in stream:
                if not reply:  # the prefill is done: how much of the prompt came from the store
                    context = await _context(self.engine, tokens, turn.salt)
                    yield Started(turn.session, number, len(tokens), stream.cached_tokens,
                                  trimmed, context=context, talker=talker)
                reply.append(token_id)
                yield Token(token_id, embed=_embedding(self.engine, token_id))
        if not reply:
            yield Started(turn.session, number, len(tokens), stream.result.cached_tokens,
                          trimmed)
        # The reply goes into the history as the generated ids, not as re-tokenized text:
        # the next turn's prompt then has exactly the tokens whose pages were just stored.
        # (With a chat template the history is text the template renders anew each turn:
        # the pages are reused up to where the reply's ids and its re-rendering differ.)
        exchange = [*message, Text(reply)] if reply else message
        session.exchanges.append((exchange, _count(exchange)))
        if self.templated:
            session.messages.append({"role": "assistant", "content": self.tokenizer.decode(
                reply)})
        session.turns = number
        eos = set(self.tokenizer.eos_token_ids) or set(self.engine.config.eos_token_ids)
        reason = "stop" if reply and reply[-1] in eos else "length"
        after = self._kv_counters()
        yield Finished(self.tokenizer.decode(reply), tuple(reply), reason,
                       {k: after[k] - before[k] for k in after})

    def _session(self, turn: Turn) -> _Session:
        """The turn's session, by its salt and name among its tenant's: a salt's sessions
        are its own, and a tenant past its quota evicts its own least recently used."""
        sessions = self.sessions.setdefault(turn.tenant, OrderedDict())
        name = (turn.salt, turn.session)
        session = sessions.get(name)
        if session is None:
            session = sessions[name] = _Session([])
            while len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        sessions.move_to_end(name)
        return session

    def _message(self, text: str, media: Prompt, *, first: bool) -> list:
        """The user's message as prompt segments, text as token ids."""
        head = Text(self.tokenizer.encode("User: " if first else "\nUser: "))
        return [head, *media.segments, Text(self.tokenizer.encode(f"{text}\nAssistant:"))]

    def _fit(self, session: _Session, message: list, max_tokens: int) -> int:
        """Drop the session's oldest turns until prompt + reply fit the context; how many."""
        limit = self.engine.config.max_position_embeddings
        fixed = _count([self.system]) + _count(message) + max_tokens
        if fixed > limit:
            raise ValueError(f"the message ({_count(message)} tokens) and max_tokens="
                             f"{max_tokens} do not fit the model's context of {limit} tokens")
        trimmed = 0
        while fixed + sum(n for _, n in session.exchanges) > limit:
            session.exchanges.pop(0)
            trimmed += 1
        return trimmed


    async def _fit_template(self, session: _Session, max_tokens: int
                            ) -> tuple[int, Prompt, PromptTokens]:
        """Drop the session's oldest exchanges until its rendered conversation and the reply
        fit the context; how many, and the prompt and its tokens (rendered in a worker
        thread)."""
        limit, trimmed = self.engine.config.max_position_embeddings, 0
        while True:
            prompt, tokens = await trio.to_thread.run_sync(_templated, self.engine,
                                                           session.messages)
            if len(tokens) + max_tokens <= limit or len(session.messages) <= 1:
                break
            del session.messages[:2]  # the oldest user message and its reply
            trimmed += 1
        if len(tokens) + max_tokens > limit:
            raise ValueError(f"the message ({len(tokens)} tokens) and max_tokens={max_tokens} "
                             f"do not fit the model's context of {limit} tokens")
        return trimmed, prompt, tokens

    def _kv_counters(self) -> dict[str, int]:
        if self.store is None:
            return {"promoted": 0, "from_disk": 0, "demoted": 0}
        stats = self.store.stats()
        tiers = [name for name in ("device", "host", "disk") if name in stats]
        return {"promoted": stats[tiers[0]]["promotions"],
                "from_disk": stats["disk"]["hits"] if "disk" in stats else 0,
                "demoted": sum(stats[name]["demotions"] for name in tiers)}


def _engine(model: str, seed: int) -> TorchEngine:
    """The LLM on the runtime's KV store (None when the runtime has none: the engine's own)."""
    kv = omni.context().kv
    store = kv if kv is not None else "auto"
    if not model:
        engine = TorchEngine.tiny(seed=seed, store=store, page_size=PAGE_SIZE)
    else:
        engine = TorchEngine.from_pretrained(model, store=store, page_size=PAGE_SIZE)
    if engine.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json: the dialogue needs text")
    return engine


def _templated(engine: TorchEngine, messages: list[dict]) -> tuple[Prompt, PromptTokens]:
    """The conversation through the checkpoint's chat template: the prompt and its tokens
    (images and audio in place, with a Qwen3-Omni checkpoint)."""
    rendered = engine.chat_prompt(messages)
    prompt = rendered if isinstance(rendered, Prompt) else Prompt(Text(rendered))
    return prompt, engine.prepare(prompt)


def _content(text: str, media: tuple) -> list[dict]:
    """A user message's parts as a Qwen3-Omni chat template takes them: media, then text."""
    parts = [{"type": "image", "image": m} if isinstance(m, Image) else
             {"type": "audio", "audio": m} for m in media]
    return [*parts, {"type": "text", "text": text}]


async def _context(engine: TorchEngine, tokens: PromptTokens, salt: str) -> Any:
    """What Qwen3-Omni's talker reads of a prompt the thinker has just prefilled (None for
    another model)."""
    if not QWEN3_OMNI:
        return None
    return await trio.to_thread.run_sync(thinker_context, engine, tokens, salt)


def _embedding(engine: TorchEngine, token_id: int) -> Any:
    """A reply token's thinker embedding, for Qwen3-Omni's talker (None otherwise)."""
    return reply_embeddings(engine, [token_id])[0] if QWEN3_OMNI else None


def _count(segments: list) -> int:
    """Tokens of prompt segments whose text is token ids."""
    return sum(len(s.content) if isinstance(s, Text) else s.num_positions for s in segments)


@omni.node(concurrency=16)  # a stream per reply the LLM writes at once
class Speech:
    """The speech decoder: passes the LLM's events on and adds an `AudioChunk` after every
    `tokens_per_chunk` tokens (and after the last ones)."""

    def __init__(self, tokens_per_chunk: int = TOKENS_PER_CHUNK, model: str = MODEL,
                 seed: int = 0):
        self.talker = Talker.from_pretrained(model) if QWEN3_OMNI else None
        self.decoder = SpeechDecoder(CONFIG.vocab_size, sample_rate=SAMPLE_RATE, seed=seed)
        self.tokens_per_chunk = tokens_per_chunk

    async def __call__(self, reply: AsyncIterator[Event]) -> AsyncIterator[Event]:
        if self.talker is not None:
            async for event in self._talk(reply):
                yield event
            return
        pending: list[int] = []
        speak = True
        async for event in reply:
            if isinstance(event, Started):
                speak = event.speak
            if isinstance(event, Finished) and pending:
                yield await self._chunk(pending)
                pending = []
            yield event
            if isinstance(event, Token) and speak:
                pending.append(event.id)
                if len(pending) == self.tokens_per_chunk:
                    yield await self._chunk(pending)
                    pending = []

    async def _chunk(self, token_ids: list[int]) -> AudioChunk:
        samples = await trio.to_thread.run_sync(self.decoder.decode_chunk, token_ids)
        return AudioChunk(samples)

    async def _talk(self, reply: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """Qwen3-Omni's talker: it reads the thinker's prompt (`Started.context`) and each
        token as it comes, and speaks two tokens behind the text."""
        assert self.talker is not None
        session = None
        try:
            async for event in reply:
                if isinstance(event, Started) and event.speak and event.context is not None:
                    sampling = _talker_sampling(event.talker or {})
                    session = self.talker.session(event.context, voice=event.voice,
                                                  sampling=sampling)
                chunks = []
                if isinstance(event, Finished) and session is not None:
                    chunks = await session.finish()
                for samples in chunks:
                    yield AudioChunk(samples)
                yield event
                if isinstance(event, Token) and session is not None:
                    for samples in await session.feed(event.id, event.embed):
                        yield AudioChunk(samples)
        finally:  # an abandoned reply gives its talker row back
            if session is not None:
                session.close()


def _talker_frames(reply_tokens: int | None) -> int:
    """The talker's codec tokens for a reply of at most `reply_tokens` (FRAMES_PER_TOKEN)."""
    return min(MAX_TALKER_TOKENS, FRAMES_PER_TOKEN * (reply_tokens or MAX_TOKENS_LIMIT) + 16)


def _talker_sampling(fields: dict) -> SamplingParams:
    """The talker's sampling: the request's fields over transformers' defaults, at most the
    talker's context in codec tokens."""
    params = talker_params(**fields)
    if params.max_new_tokens is None or params.max_new_tokens > MAX_TALKER_TOKENS:
        raise ValueError(f"stages.talker.max_new_tokens must be at most {MAX_TALKER_TOKENS}, "
                         f"got {params.max_new_tokens}")
    return params


@omni.node
async def write_reply(turn: Turn, spoken: AsyncIterator[Event]) -> dict:
    """Write the audio chunks to the WAV file as they come; assemble the turn's result."""
    started = finished = writer = None
    ttft = first_audio = None
    try:
        async for event in spoken:
            now = time.perf_counter() - turn.started
            if isinstance(event, Started):
                started = event
                writer = WavWriter(_wav_path(turn, event.turn), SPEECH_RATE)
            elif isinstance(event, Token) and ttft is None:
                ttft = now
            elif isinstance(event, AudioChunk):
                first_audio = now if first_audio is None else first_audio
                writer.write(event.samples)
            elif isinstance(event, Finished):
                finished = event
    finally:
        if writer is not None:
            writer.close()
    if started is None or finished is None:
        raise RuntimeError("the reply stream ended early")
    return {
        "session": started.session, "turn": started.turn, "reply": finished.text,
        "prompt_tokens": started.prompt_tokens, "cached_tokens": started.cached_tokens,
        "new_tokens": started.prompt_tokens - started.cached_tokens,
        "generated_tokens": len(finished.token_ids), "token_ids": list(finished.token_ids),
        "finish_reason": finished.finish_reason, "trimmed_turns": started.trimmed_turns,
        "ttft_s": ttft, "first_audio_s": first_audio,
        "total_s": time.perf_counter() - turn.started,
        "wav": str(writer.path.resolve()), "audio_s": writer.seconds, "kv": finished.kv,
    }


def _wav_path(turn: Turn, number: int) -> Path:
    if turn.out is not None:
        path = Path(turn.out)
    else:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", turn.session)
        path = Path(os.environ.get("OMNI_DIALOGUE_OUT", ".")) / f"{safe}-{number}.wav"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@omni.graph
def dialogue(session: str, text: str, audio: Annotated[str, omni.InputFile()] = "",
             image: Annotated[str, omni.InputFile()] = "",
             out: Annotated[str, omni.OutputFile(".wav")] = "", max_tokens: int = 32,
             salt: Annotated[str, omni.CacheSalt()] = "",
             tenant: Annotated[str, omni.CacheSalt(per="tenant")] = ""):
    turn = begin(session, text, out, max_tokens, salt, tenant)
    reply = Dialogue()(turn, hear(audio), look(image))
    return write_reply(turn, Speech()(reply))


# -- the same LLM and speech decoder behind POST /v1/chat/completions (`omni serve`) ---------


@omni.node(concurrency=16)  # as many as the engine decodes at once (its max_batch)
class Chat:
    """The LLM for a chat client, which sends the whole conversation every turn: no session
    state here. The messages are rendered as `Dialogue` renders a session, so turn k's prompt
    starts with turn k-1's and the store holds its pages (`cached_tokens`)."""

    def __init__(self, model: str = MODEL, seed: int = 0):
        self.engine = _engine(model, seed)
        self.tokenizer = self.engine.tokenizer
        self.templated = has_chat_template(self.engine)

    async def __call__(self, request: ChatRequest) -> AsyncIterator[Event]:
        prompt, tokens = await self._prompt(request.messages)
        # the client's sampling over the checkpoint's generation_config.json defaults
        params = request.params_over(self.engine.default_params(len(tokens) if tokens else 0))
        if params.n > 1:  # one prefill, n rows: the whole replies at the end
            result = await self.engine.generate(prompt, params,
                                                cache_salt=request.cache_salt)
            yield Started("", 0, result.prompt_tokens, result.cached_tokens, 0, speak=False)
            for i, sample in enumerate(result.samples):
                yield Finished(sample.text or "", tuple(sample.token_ids),
                               sample.finish_reason, {}, index=i)
            return
        context = None
        talker = {"max_new_tokens": _talker_frames(params.max_new_tokens),
                  **(request.stages or {}).get("talker", {})}
        stream = self.engine.stream(prompt, params, cache_salt=request.cache_salt)
        deltas, started = _Deltas(self.tokenizer, params.stop), False
        async with contextlib.aclosing(stream):
            async for token_id in stream:
                if not started:
                    started = True
                    if request.audio and tokens:  # what the talker reads of the prompt
                        context = await _context(self.engine, tokens, request.cache_salt)
                    yield Started("", 0, stream.prompt_tokens, stream.cached_tokens, 0,
                                  speak=request.audio, context=context,
                                  voice=request.voice, talker=talker)
                yield Token(token_id, deltas.add(token_id),
                            _embedding(self.engine, token_id) if context else None)
        result = stream.result
        if not started:
            yield Started("", 0, result.prompt_tokens, result.cached_tokens, 0,
                          speak=request.audio, context=context, voice=request.voice,
                          talker=talker)
        yield Finished(result.text or "", tuple(result.token_ids), result.finish_reason, {})

    async def _prompt(self, messages: tuple[ChatMessage, ...]
                      ) -> tuple[Prompt, PromptTokens | None]:
        """The conversation as the model's prompt, and its tokens when known (else None).

        With the checkpoint's chat template: rendered and tokenized as transformers'
        `apply_chat_template(add_generation_prompt=True)` does, in a worker thread, after
        its length alone was checked against the context. Else (the built-in tiny model) the
        transcript `Dialogue` writes; text stays text there, so the engine refuses a prompt
        too long for its context from its length and tokenizes a long one off the loop."""
        if not self.templated:
            return Prompt(self._render(messages)), None
        if QWEN3_OMNI:  # text, images and audio, in place
            turns = [{"role": m.role, "content": _parts(m)} for m in messages]
            self.engine.check_length(Prompt([Text(p["text"]) if p["type"] == "text"
                                             else p[p["type"]] for t in turns
                                             for p in t["content"]]))
        else:
            turns = [{"role": m.role, "content": _text_of(m, self.engine.model_id)}
                     for m in messages]
            self.engine.check_length(Prompt([Text(t["content"]) for t in turns]))
        return await trio.to_thread.run_sync(_templated, self.engine, turns)

    def _render(self, messages: tuple[ChatMessage, ...]) -> list:
        """System text, then "User: ..." and "\\nAssistant:..." as `Dialogue` writes them (each
        segment tokenized on its own, as `Dialogue` encodes them)."""
        system = [p for m in messages if m.role == "system" for p in m.parts]
        segments: list = [Text("".join(system) + "\n") if system else Text(SYSTEM)]
        first = True
        for message in (m for m in messages if m.role != "system"):
            if message.role == "user":
                segments.append(Text("User: " if first else "\nUser: "))
                first = False
            else:
                segments.append(Text("\nAssistant:"))
            segments += [_segment(part) for part in message.parts]
        if messages[-1].role != "assistant":
            segments.append(Text("\nAssistant:"))
        return segments


def has_chat_template(engine: TorchEngine) -> bool:
    """Whether `engine`'s checkpoint brings a chat template (the built-in tiny model has
    none: it gets this file's own transcript)."""
    return getattr(engine.tokenizer, "chat_template", None) is not None


def _text_of(message: ChatMessage, model: str) -> str:
    """A message's text, for a chat template (ValueError for media: a text model's template
    takes none)."""
    if any(not isinstance(part, str) for part in message.parts):
        raise ValueError(f"{model} is a text model: its chat template takes no image or "
                         "audio")
    return "".join(message.parts)


def _parts(message: ChatMessage) -> list[dict]:
    """A message's parts as a Qwen3-Omni chat template takes them."""
    parts = []
    for part in message.parts:
        segment = _segment(part)
        kind = ("image" if isinstance(segment, Image) else "audio"
                if isinstance(segment, Audio) else "text")
        parts.append({"type": kind, kind: part if kind == "text" else segment})
    return parts


def _segment(part: object) -> object:
    """A message part as a prompt segment (the one the server built off the event loop, when
    it did); ValueError for audio the encoder cannot take."""
    if isinstance(part, ImagePart):
        return part.segment or Image(part.pixels)
    if isinstance(part, AudioPart):
        if part.sample_rate != SAMPLE_RATE:
            raise ValueError(f"input_audio must be {SAMPLE_RATE} Hz, got {part.sample_rate} "
                             f"Hz (ffmpeg -i IN -ac 1 -ar {SAMPLE_RATE} OUT.wav)")
        return part.segment or Audio(part.samples, part.sample_rate)
    return Text(part)


@omni.node
async def to_openai(spoken: AsyncIterator[Event]) -> AsyncIterator[object]:
    """The reply as the chat endpoint's events: the start, text, audio chunks, the finish."""
    sent: dict[int, int] = {}  # characters of text sent, per choice
    async for event in spoken:
        if isinstance(event, Started):
            yield ChatStart(event.prompt_tokens, event.cached_tokens)
        elif isinstance(event, AudioChunk):
            yield ChatAudio(event.samples, SPEECH_RATE)
        elif isinstance(event, Token) and event.text:
            sent[0] = sent.get(0, 0) + len(event.text)
            yield ChatText(event.text)
        elif isinstance(event, Finished):
            rest = event.text[sent.get(event.index, 0):]
            if rest:
                yield ChatText(rest, event.index)
            yield ChatEnd(event.finish_reason, len(event.token_ids), event.index)


class _Deltas:
    """A reply's text as tokens arrive: what is new once it decodes whole, never the start of
    a `stop` string (held back until it is known not to be one; the engine cuts the rest).

    Why the window: a token's text can depend on the one before it (a word-start marker), so
    each step decodes the last few tokens and keeps what the new one added; decoding the
    whole reply every step would cost quadratic time."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]):
        self.decode, self.stops = tokenizer.decode, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.start = self.read = 0  # ids[start:read] decoded already: the context of the next
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> str:
        """The text that `token_id` makes safe to send ("" while it is pending)."""
        self.ids.append(token_id)
        before = self.decode(self.ids[self.start:self.read])
        after = self.decode(self.ids[self.start:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.start, self.read = self.read, len(self.ids)
        tail = max(0, self.sent - self.hold)
        cuts = [i for i in (self.text.find(s, tail) for s in self.stops) if i >= 0]
        end = min(cuts) if cuts else len(self.text) - self.hold
        new = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(new)
        return new


@chat_completions
@omni.graph
def chat(request: ChatRequest):
    reply = Chat()(request)
    return to_openai(Speech()(reply))
