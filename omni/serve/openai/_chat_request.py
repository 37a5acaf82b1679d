"""A chat completion's body checked and turned into the `ChatRequest` its graph takes."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Literal

import trio

from omni.serve._errors import ApiError
from omni.serve._tenants import cache_salt, tenant_salt
from omni.serve.openai._chat_models import ChatCompletionRequest, Message
from omni.serve.openai._declare import AudioPart, ChatMessage, ChatRequest, ImagePart
from omni.serve.openai._media import MediaPolicy, MediaSource, decode_media

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_SCHEMA_BYTES", "ChatPolicy", "chat_request", "given_sampling",
           "sampling_params"]

DEFAULT_MAX_TOKENS = 128
# The most bytes of JSON a response_format schema may hold. A grammar's compilation cannot be
# interrupted and its time grows much faster than its size (an object of 800 optional
# properties, 23 KB, compiles in 0.25 s; of 1,600, 47 KB, in 27 s): a client's schema is
# bounded before any of it is compiled.
MAX_SCHEMA_BYTES = 16 << 10
# SamplingParams' names as the request spells them, for errors that name the field.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed",
                 "json_schema": "response_format", "ebnf": "response_format"}
_SAMPLING = ("temperature", "top_p", "n", "stop", "frequency_penalty", "presence_penalty",
             "logit_bias", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ChatPolicy:
    """What the operator sets for every chat completion (``omni serve``'s options).

    Args:
        system_prompt: the system message of a conversation that has none (None: none is
            added; a chat template may add its own, as transformers renders it).
        json_whitespace: the whitespace a ``response_format`` JSON reply may hold between
            its tokens: "any" (SGLang's default) or "compact" (none, beyond one space after
            ``,`` and ``:``; SGLang's ``--constrained-json-disable-any-whitespace``), which
            keeps a small model from writing blanks until ``max_tokens``. The schema then
            travels to the graph as the EBNF grammar it compiles to (`ebnf`).
    """

    system_prompt: str | None = None
    json_whitespace: Literal["any", "compact"] = "any"

    def __post_init__(self) -> None:
        if self.json_whitespace not in ("any", "compact"):
            raise ValueError(f"json_whitespace must be 'any' or 'compact', got "
                             f"{self.json_whitespace!r}")


async def chat_request(body: ChatCompletionRequest, media: MediaPolicy, tenant: str = "",
                       policy: ChatPolicy = ChatPolicy(), *,
                       hold: AsyncExitStack | None = None) -> ChatRequest:
    """The graph's input for a checked body of `tenant`, its media decoded under `media` (in
    worker threads, every item's header checked before any is decoded), its cache salt the
    tenant's and the body's, the operator's system prompt first when the conversation has
    no system message, a JSON reply's whitespace as `policy` says; `ApiError` 400 for
    values out of range, 429 when the media budget in flight has no room. The media's share
    of that budget is held until `hold` closes (`decode_media`)."""
    audio = "audio" in (body.modalities or ["text"])
    if audio and body.audio is None:
        raise ApiError(400, 'audio: modalities ["text", "audio"] needs audio: {"voice": '
                            '..., "format": "wav"}', param="audio")
    if audio and (body.n or 1) > 1:
        raise ApiError(400, "n: a spoken reply has one choice; send n=1 or no audio",
                       param="n")
    decoded = iter(await decode_media(_media_sources(body.messages), media, hold))
    messages = tuple(_message(m, decoded) for m in body.messages)
    if policy.system_prompt and not any(m.role == "system" for m in messages):
        messages = (ChatMessage("system", (policy.system_prompt,)), *messages)
    given = given_sampling(body)
    if policy.json_whitespace == "compact" and "json_schema" in given:
        given["ebnf"] = await _compact_json(given.pop("json_schema"))
    stages = {name: _stage_sampling(name, fields) for name, fields in (body.stages or {}).items()}
    return ChatRequest(body.model, messages, sampling_params(given), audio,
                       cache_salt(tenant, body.cache_salt or ""), given,
                       voice=_voice(body) if audio else None, stages=stages,
                       tenant=tenant_salt(tenant))


def _voice(body: ChatCompletionRequest) -> str | None:
    """The voice's name (OpenAI's {"id": ...} form too)."""
    voice = body.audio.voice if body.audio is not None else None
    if isinstance(voice, dict):
        voice = voice.get("id")
    return voice if isinstance(voice, str) else None


def _stage_sampling(name: str, fields: Any) -> dict[str, Any]:
    """A later stage's sampling fields, checked as `SamplingParams` checks them (`ApiError`
    400 naming the field)."""
    given = {("sampling_seed" if k == "seed" else k): v
             for k, v in fields.model_dump(exclude_none=True).items()}
    sampling_params(given, where=f"stages.{name}", names={"sampling_seed": "seed"})
    return given


def given_sampling(body: ChatCompletionRequest) -> dict[str, Any]:
    """The `SamplingParams` fields the request sets itself (what a graph lays over its
    model's own defaults, `ChatRequest.params_over`)."""
    fields: dict[str, Any] = {k: getattr(body, k) for k in _SAMPLING
                              if getattr(body, k) is not None}
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else (
        body.max_tokens)
    if limit is not None:
        fields["max_new_tokens"] = limit
    if body.seed is not None:
        fields["sampling_seed"] = body.seed
    grammar = _json_schema(body)
    if grammar is not None:
        fields["json_schema"] = grammar
    return fields


def sampling_params(given: dict[str, Any], *, where: str = "",
                    names: dict[str, str] = _OPENAI_NAMES) -> Any:
    """The `SamplingParams` of a request that set `given` (`given_sampling`: its fields over
    SGLang's defaults, at most `DEFAULT_MAX_TOKENS` new tokens unless it says); `ApiError`
    400 naming the field out of range, as the request spells it (`names`), under `where`
    (a later stage's: "stages.talker")."""
    from omni.compute.sampling_params import SamplingParams

    fields = {"max_new_tokens": DEFAULT_MAX_TOKENS, **given}
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        text = str(exc)
        name = text.split(" ", 1)[0]
        param = names.get(name, name)
        if name in names:
            text = text.replace(name, param, 1)
        if where:
            text, param = f"{where}: {text}", f"{where}.{param}"
        raise ApiError(400, text, param=param) from None


def _json_schema(body: ChatCompletionRequest) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if importlib.util.find_spec("xgrammar") is None:
        raise ApiError(400, f"response_format {fmt.type}: this server cannot constrain "
                            "output (xgrammar is not installed)", param="response_format")
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "response_format.json_schema.schema: required for type "
                            "json_schema", param="response_format.json_schema.schema")
    schema = json.dumps(fmt.json_schema.schema_)
    if len(schema) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"response_format.json_schema.schema: {len(schema):,} bytes of "
                            f"JSON, more than the {MAX_SCHEMA_BYTES:,} this server compiles",
                       param="response_format.json_schema.schema")
    return schema


async def _compact_json(schema: str) -> str:
    """The EBNF grammar of `schema` without free whitespace, worked out in a worker thread
    (a schema is the client's: its size is bounded by the body's only)."""
    from omni.compute.grammar import json_schema_ebnf

    try:
        return await trio.to_thread.run_sync(
            lambda: json_schema_ebnf(schema, any_whitespace=False))
    except ValueError as exc:
        raise ApiError(400, f"response_format: invalid json_schema: {exc}",
                       param="response_format") from None


def _media_sources(messages: list[Message]) -> list[MediaSource]:
    """Every image and clip of the conversation, in order, as the request holds them;
    `ApiError` 400 for a message without content, and for media outside a user message."""
    sources = []
    for i, message in enumerate(messages):
        where = f"messages.{i}.content"
        if message.content is None:
            raise ApiError(400, f"{where}: required", param=where)
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            at = f"{where}.{j}"
            if part.type != "text" and message.role != "user":
                raise ApiError(400, f"{at}: only user messages may hold {part.type} parts",
                               param=at)
            if part.type == "image_url":
                sources.append(MediaSource(f"{at}.image_url.url", "image", part.image_url.url))
            elif part.type == "input_audio":
                sources.append(MediaSource(f"{at}.input_audio", "audio",
                                           part.input_audio.data, part.input_audio.format))
    return sources


def _message(message: Message, media: Iterator[ImagePart | AudioPart]) -> ChatMessage:
    """A checked message (`_media_sources`), its media parts taken in order from `media`."""
    role = "system" if message.role == "developer" else message.role
    if isinstance(message.content, str):
        return ChatMessage(role, (message.content,))
    return ChatMessage(role, tuple(part.text if part.type == "text" else next(media)
                                   for part in message.content))
