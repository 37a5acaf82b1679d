"""The body of ``POST /v1/chat/completions`` as pydantic models: OpenAI's field names, the
fields Omni serves and nothing else (an unknown field is refused by name)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from omni.serve._tenants import MAX_CACHE_SALT_CHARS

__all__ = ["ChatCompletionRequest", "Message"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Strict):
    data: str
    format: str


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


Part = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]
# A message's content is text or a list of parts, told apart by its JSON type, so that a
# refusal names the field inside the part, not the union's other branch.
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[Part], Tag("parts")],
    Discriminator(lambda value: "text" if isinstance(value, str) else
                  "parts" if isinstance(value, list) else None,
                  custom_error_type="content_type",
                  custom_error_message="expected a string or a list of parts")]


class Message(_Strict):
    """One message: system and developer messages are text, user messages may hold images
    and audio, assistant messages are the earlier replies (text)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Content | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class AudioOptions(_Strict):
    """The spoken reply: `voice` names the speaker (a Qwen3-Omni checkpoint's; the built-in
    speech decoder has one voice and takes any name);
    `format` is "wav" (a whole reply) or "pcm16" (raw 16-bit samples); a stream always
    sends PCM16 chunks."""

    voice: str | dict[str, Any]
    format: Literal["wav", "pcm16"] = "wav"


class JsonSchema(_Strict):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StageSampling(_Strict):
    """One later stage's sampling (a talker's), in SGLang's `SamplingParams` names."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    seed: int | None = None


class ChatCompletionRequest(_Strict):
    """The fields Omni serves: OpenAI's, plus SGLang's ``top_k``, ``min_p`` and
    ``repetition_penalty``, vLLM's ``cache_salt`` and, per later stage, its own sampling
    (``stages: {"talker": {...}}``; the request's own fields are the first stage's) (as
    ``extra_body`` from the official client)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)
    stages: dict[Literal["talker"], StageSampling] | None = None
