"""Which OpenAI endpoint a graph serves, and the values that cross between route and graph.

A graph file marks a graph with `chat_completions` or `image_generations` (decorators above
``@omni.graph``); ``omni serve`` then adds the endpoint for it. The marks only set an
attribute: the graph is returned unchanged and ``omni run`` runs it as before. This module
imports neither torch nor the web stack, so a graph file pays nothing for it.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_COMPLETIONS", "IMAGE_GENERATIONS", "AudioPart", "ChatAudio", "ChatEnd",
           "ChatMessage", "ChatRequest", "ChatStart", "ChatText", "ImagePart",
           "chat_completions", "edits_images", "endpoint_of", "image_generations"]

CHAT_COMPLETIONS = "chat.completions"
IMAGE_GENERATIONS = "images.generations"
IMAGE_INPUTS = ("prompt", "out", "width", "height", "seed", "png")
EDIT_INPUT = "image"  # the input an image graph takes an edit's image on
_ATTRIBUTE = "openai_endpoint"


def chat_completions(graph: Any) -> Any:
    """Mark `graph` as the one behind ``POST /v1/chat/completions`` (model id: its name).

    The graph takes one input, ``request`` (a `ChatRequest`), and returns a stream of
    `ChatStart`, `ChatText`, `ChatAudio` and `ChatEnd` events.

    Raises:
        TypeError: `graph` is not an ``@omni.graph`` or has no input named ``request``.
    """
    return _mark(graph, CHAT_COMPLETIONS, ("request",))


def image_generations(graph: Any) -> Any:
    """Mark `graph` as the one behind ``POST /v1/images/generations`` (model id: its name).

    The graph has the inputs ``prompt``, ``out``, ``width``, ``height``, ``seed`` and
    ``png`` (and may have ``negative_prompt``, ``steps`` and ``guidance``, which the request's
    fields of those meanings set); the route passes ``out=""`` and ``png=True``, and the
    graph's result is a dict whose ``"png"`` holds the image's PNG bytes and, optionally,
    ``"usage"``: ``{"input_tokens": N, "cached_tokens": M}`` (the prompt's tokens, and how
    many of them had their KV found cached).

    A graph whose input ``image`` takes an `ImagePart` answers ``POST /v1/images/edits`` too
    (`edits_images`): the route passes the uploaded image, decoded, there (and a graph's
    ``strength`` input, if it has one, gets the request's).

    Raises:
        TypeError: `graph` is not an ``@omni.graph`` or lacks one of those inputs.
    """
    return _mark(graph, IMAGE_GENERATIONS, IMAGE_INPUTS)


def edits_images(graph: Any) -> bool:
    """Whether the image graph `graph` answers ``POST /v1/images/edits``: its input ``image``
    takes an `ImagePart` (``Annotated[str | ImagePart, omni.InputFile()]``, say, which takes a
    file's path from ``omni run`` as well)."""
    annotation = next((i.type for i in getattr(graph, "inputs", None) or ()
                       if i.name == EDIT_INPUT), None)
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    return ImagePart in (typing.get_args(annotation) if union else (annotation,))


def endpoint_of(graph: Any) -> str | None:
    """The OpenAI endpoint `graph` is marked for (`CHAT_COMPLETIONS`...), or None."""
    return getattr(graph, _ATTRIBUTE, None)


def _mark(graph: Any, endpoint: str, inputs: tuple[str, ...]) -> Any:
    names = [i.name for i in getattr(graph, "inputs", None) or ()]
    if not hasattr(graph, "plan") or not hasattr(graph, "inputs"):
        raise TypeError(f"@{endpoint.replace('.', '_')} marks a graph: put it above "
                        f"@omni.graph, got {graph!r}")
    missing = [name for name in inputs if name not in names]
    if missing:
        raise TypeError(f"graph '{graph.name}' serves {endpoint} only with the input(s) "
                        f"{', '.join(inputs)}; it lacks {', '.join(missing)}")
    setattr(graph, _ATTRIBUTE, endpoint)
    return graph


# -- what the chat route hands its graph, and what the graph streams back -------------------


@dataclass(frozen=True, eq=False)
class ImagePart:
    """An image of a message: RGB pixels, ``uint8 [H, W, 3]`` (a numpy array), and
    `segment`, the prompt segment of those pixels (an `omni.compute.Image`) that the server
    built, content digest included, in its decode thread: a graph that puts it in a prompt
    makes no pass over the pixels on the event loop (None in a part made by hand)."""

    pixels: Any
    segment: Any = None


@dataclass(frozen=True, eq=False)
class AudioPart:
    """An audio clip of a message: mono float32 samples in [-1, 1], their rate, and
    `segment`, the prompt segment of those samples (an `omni.compute.Audio`) built, as an
    `ImagePart`'s, off the event loop (None in a part made by hand)."""

    samples: Any
    sample_rate: int
    segment: Any = None


@dataclass(frozen=True, eq=False)
class ChatMessage:
    """One message of the conversation: its role ("system", "user" or "assistant") and
    its parts in order (str, `ImagePart`, `AudioPart`)."""

    role: str
    parts: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class ChatRequest:
    """A checked chat request. Why a plain object: the graph renders the whole conversation
    itself (no session state), and `params` is already an `omni.compute.SamplingParams`."""

    model: str
    messages: tuple[ChatMessage, ...]
    params: Any  # omni.compute.SamplingParams
    audio: bool = False  # modalities includes "audio": the reply is spoken too
    # what the graph salts its cache with (`TorchEngine.generate(..., cache_salt=)`): the
    # server's, per tenant (API key) and the request's own cache_salt
    cache_salt: str = ""
    # the SamplingParams fields the client set itself (`params` lays them over SGLang's
    # defaults; `params_over` over the model's own)
    sampling: Any = None
    voice: str | None = None  # the spoken reply's voice (audio.voice)
    # later stages' sampling fields, by stage ("talker"), as the client set them
    stages: Any = None
    # the tenant's own salt (`omni.CacheSalt(per="tenant")`'s value), the same whatever the
    # request's cache_salt: what a graph keys per-tenant state by (a quota per tenant)
    tenant: str = ""

    def params_over(self, defaults: Any) -> Any:
        """The request's sampling laid over `defaults` (a model's `SamplingParams`, e.g. its
        generation_config.json's): what the client set wins, the rest is the model's."""
        import dataclasses

        return dataclasses.replace(defaults, **(self.sampling or {}))


@dataclass(frozen=True)
class ChatStart:
    """The graph's first event, once the prompt is read: its tokens, and how many of them
    had their KV found in the store."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class ChatText:
    """Text of choice `index`, in order (concatenated, the choice's whole reply)."""

    text: str
    index: int = 0


@dataclass(frozen=True, eq=False)
class ChatAudio:
    """Speech of choice `index`: mono float32 samples, in order."""

    samples: Any
    sample_rate: int
    index: int = 0


@dataclass(frozen=True)
class ChatEnd:
    """Choice `index` is done: why ("stop" or "length") and how many tokens it generated."""

    finish_reason: str
    completion_tokens: int
    index: int = 0
