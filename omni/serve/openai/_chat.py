"""``POST /v1/chat/completions``: a conversation in, the declared chat graph's reply out, as
one JSON object or as server-sent chunks ending in ``[DONE]``."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.graph.errors import NodeError
from omni.serve._errors import ApiError, error_body
from omni.serve._guard import until_answered
from omni.serve._requests import DONE, graph_error, json_body, outputs, until_disconnected
from omni.serve._tenants import tenant_of
from omni.serve.openai import _audio
from omni.serve.openai._body import validated
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import ChatPolicy, chat_request
from omni.serve.openai._declare import ChatAudio, ChatEnd, ChatRequest, ChatStart, ChatText
from omni.serve.openai._media import MediaPolicy

__all__ = ["chat_route"]


def chat_route(runtime: Any, graphs: Mapping[str, Any], find: Callable[[str], Any],
               media: MediaPolicy, policy: ChatPolicy
               ) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler; `find(model)` is the chat graph serving `model` (or `ApiError`
    404); messages' media are taken under `media`, the operator's system prompt and JSON
    whitespace from `policy`."""

    async def chat_completions(request: Request) -> Response:
        body = validated(ChatCompletionRequest, await json_body(request),
                         "chat completions")
        graph = find(body.model)
        chat = await chat_request(body, media, tenant_of(request), policy,
                                  hold=until_answered(request))
        reply = _Reply(body.model, chat.audio, body.audio.format if body.audio else "wav")
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return EventSourceResponse(_chunks(runtime, graph, chat, reply, usage), ping=15)
        done = await until_disconnected(request, lambda: _collect(runtime, graph, chat, reply))
        if done is None:
            return Response(status_code=499)  # nobody is there to read it
        return JSONResponse(reply.completion())

    return chat_completions


@dataclass
class _Choice:
    """One choice as its events arrive: why: the JSON answer needs it whole."""

    text: list[str] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 0
    audio_id: str = ""
    end: ChatEnd | None = None


@dataclass
class _Reply:
    """A reply being assembled: why: usage and choices are known only at the end, the
    stream's chunks share one id."""

    model: str
    spoken: bool
    audio_format: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    start: ChatStart | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    num_sent: int = 0  # chunks a stream of it has sent

    def choice(self, index: int) -> _Choice:
        return self.choices.setdefault(index, _Choice())

    def restart(self) -> None:
        """Forget what came of a run: the request runs again (`outputs`)."""
        self.start, self.choices = None, {}

    def usage(self) -> dict[str, Any]:
        prompt = self.start.prompt_tokens if self.start else 0
        completion = sum(c.end.completion_tokens for c in self.choices.values() if c.end)
        cached = self.start.cached_tokens if self.start else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [self._message(i, c) for i, c in sorted(self.choices.items())],
                "usage": self.usage()}

    def _message(self, index: int, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.spoken:
            samples = (np.concatenate(choice.audio) if choice.audio
                       else np.zeros(0, np.float32))
            data = (_audio.wav_bytes(samples, choice.sample_rate or 16_000)
                    if self.audio_format == "wav" else _audio.pcm16(samples))
            # the text stays in content too (OpenAI leaves it null: a client reading content
            # still gets the reply), and is the audio's transcript
            message["audio"] = {"id": _audio.audio_id(), "data": _audio.b64(data),
                                "expires_at": _audio.expires_at(), "transcript": text}
        return {"index": index, "message": message, "logprobs": None,
                "finish_reason": choice.end.finish_reason if choice.end else "stop"}

    def chunk(self, choices: list[dict[str, Any]], usage: bool) -> str:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None, "choices": choices}
        if usage:
            body["usage"] = None
        return json.dumps(body, ensure_ascii=False)


def _note(reply: _Reply, event: Any) -> None:
    """Add a graph event to the reply."""
    if isinstance(event, ChatStart):
        reply.start = event
    elif isinstance(event, ChatText):
        reply.choice(event.index).text.append(event.text)
    elif isinstance(event, ChatAudio):
        choice = reply.choice(event.index)
        choice.audio.append(np.asarray(event.samples, dtype=np.float32))
        choice.sample_rate = event.sample_rate
    elif isinstance(event, ChatEnd):
        reply.choice(event.index).end = event
    else:
        raise TypeError(f"a chat graph streams ChatStart, ChatText, ChatAudio and ChatEnd, "
                        f"got {type(event).__name__}")


async def _collect(runtime: Any, graph: Any, chat: ChatRequest, reply: _Reply) -> bool:
    """Gather the whole reply (run again if a worker is lost midway: nothing was sent)."""
    async for _, event in outputs(runtime, graph, {"request": chat}, unsent=lambda: True,
                                  restart=reply.restart):
        _note(reply, event)
    return True


async def _chunks(runtime: Any, graph: Any, chat: ChatRequest, reply: _Reply,
                  usage: bool) -> AsyncIterator[dict[str, str]]:
    """The stream's events: a role chunk per choice, deltas, finish chunks, the usage chunk
    when asked for, ``[DONE]``; a failure as an ``error`` event. A request lost with a
    worker midway runs again if no chunk was sent yet."""
    try:
        async for _, event in outputs(runtime, graph, {"request": chat},
                                      unsent=lambda: reply.num_sent == 0,
                                      restart=reply.restart):
            _note(reply, event)
            for delta in _deltas(reply, event):
                reply.num_sent += 1
                yield {"data": reply.chunk([delta], usage)}
    except NodeError as exc:
        error = graph_error(exc)
        yield {"event": "error", "data": json.dumps(error_body(
            error.status, error.message, code=error.code))}
        return
    if usage:
        yield {"data": json.dumps({**json.loads(reply.chunk([], False)),
                                   "usage": reply.usage()})}
    yield {"data": DONE}


def _deltas(reply: _Reply, event: Any) -> list[dict[str, Any]]:
    """The chunk choices an event makes (the first of a choice also carries the role)."""
    if isinstance(event, ChatStart):
        return []
    index = event.index
    choice = reply.choices[index]
    if isinstance(event, ChatEnd):
        return [{"index": index, "delta": {}, "logprobs": None,
                 "finish_reason": event.finish_reason}]
    delta: dict[str, Any] = {}
    if not choice.audio_id:
        choice.audio_id = _audio.audio_id()
        delta["role"] = "assistant"
    if isinstance(event, ChatText):
        if reply.spoken:
            delta["audio"] = {"id": choice.audio_id, "transcript": event.text}
        else:
            delta["content"] = event.text
    else:
        delta["audio"] = {"id": choice.audio_id, "expires_at": _audio.expires_at(),
                          "data": _audio.b64(_audio.pcm16(event.samples))}
    return [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]


def unknown_model(model: str, served: list[str], endpoint: str) -> ApiError:
    """The 404 for a `model` no graph serves at `endpoint`."""
    return ApiError(404, f"The model {model!r} does not exist here; {endpoint} serves: "
                         f"{', '.join(served) or 'none'}", param="model",
                    code="model_not_found")
