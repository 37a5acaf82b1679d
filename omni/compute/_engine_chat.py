"""`TorchEngine`'s conversation methods: chat templates and the checkpoint's sampling defaults.

Why apart from engine.py: rendering a conversation and choosing default sampling happen before
a request exists; they only call the engine's public `generate` / `stream`, and keeping them
here leaves engine.py to the batching loop.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from omni.compute.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
    resolve_eos_token_ids,
)
from omni.compute.prompt import Audio, Image, Prompt, Text
from omni.compute.sampling_params import SamplingParams
from omni.compute.tokenizer import HFTokenizer, load_tokenizer

if TYPE_CHECKING:
    from omni.compute.engine import GenerateResult, TokenStream

__all__ = ["ChatMixin", "load_tokenizer_and_defaults"]


def load_tokenizer_and_defaults(directory: str | Path, config_eos: tuple[int, ...],
                                tokenizer_directory: str | Path | None = None,
                                ) -> tuple[HFTokenizer | None, GenerationDefaults | None]:
    """A checkpoint's tokenizer (None without tokenizer.json; from `tokenizer_directory` when
    given) and generation_config.json (None without one); the tokenizer's EOS ids resolved
    as `resolve_eos_token_ids` says."""
    defaults = load_generation_defaults(directory)
    tokenizer = load_tokenizer(tokenizer_directory or directory)
    if tokenizer is not None:
        tokenizer.eos_token_ids = resolve_eos_token_ids(defaults, config_eos,
                                                        tokenizer.eos_token_id)
    return tokenizer, defaults


def media_parts(messages: list[dict[str, Any]]) -> list[Image | Audio]:
    """The image and audio parts of a conversation's messages, in order, as segments."""
    found: list[Image | Audio] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                value = part.get("image")
                found.append(value if isinstance(value, Image) else Image(value))
            elif kind == "audio":
                value = part.get("audio")
                found.append(value if isinstance(value, Audio) else Audio(value))
    return found


class ChatMixin:
    """`chat`, `chat_stream`, `chat_prompt` and `default_params` of `TorchEngine`."""

    tokenizer: Any
    model_id: str
    media: Any  # the engine's MediaEncoders
    # From the checkpoint's generation_config.json (`from_pretrained`); None: SamplingParams().
    generation_defaults: GenerationDefaults | None = None

    if TYPE_CHECKING:
        async def generate(self, prompt: Any, params: SamplingParams | None = None, *,
                           cache_salt: str = "") -> GenerateResult: ...
        def stream(self, prompt: Any, params: SamplingParams | None = None, *,
                   cache_salt: str = "") -> TokenStream: ...

    def default_params(self, num_prompt_tokens: int = 0) -> SamplingParams:
        """The sampling of a request that passes no params (for a prompt of that length):
        the checkpoint's generation_config.json defaults, else `SamplingParams()`."""
        if self.generation_defaults is None:
            return SamplingParams()
        return self.generation_defaults.sampling_params(num_prompt_tokens)

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int] | Prompt:
        """The prompt of a conversation: the checkpoint's chat template rendered and encoded
        exactly as transformers' ``apply_chat_template(messages, add_generation_prompt)``.

        A message's content may be a list of parts: ``{"type": "text", "text": ...}``,
        ``{"type": "image", "image": Image or what Image takes}`` and ``{"type": "audio",
        "audio": Audio or 16 kHz samples}``. With media the result is a `Prompt`: the rendered
        text with each placeholder the template writes (Qwen3-Omni's ``<|image_pad|>``) taken
        by its part's segment, in order, as transformers' processor expands them.

        Raises:
            ValueError: no tokenizer with a chat template, bad messages, the template fails,
                or its placeholders do not match the media parts.
        """
        if not isinstance(self.tokenizer, HFTokenizer) or self.tokenizer.chat_template is None:
            raise ValueError(f"{self.model_id} has no chat template (it needs tokenizer.json and "
                             "chat_template.jinja or 'chat_template' in tokenizer_config.json)")
        media = media_parts(messages)
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=not media,
            **template_kwargs)
        if not media:
            return list(rendered)
        return self._with_media(str(rendered), media)

    def _with_media(self, text: str, media: list[Image | Audio]) -> Prompt:
        """Rendered text -> a Prompt, each media placeholder replaced by its segment."""
        backend = self.tokenizer.backend
        pads = {backend.id_to_token(self.media.placeholder(segment)): type(segment)
                for segment in media}
        if None in pads or len(pads) != len({type(s) for s in media}):
            raise ValueError(f"{self.model_id} does not take images or audio in a chat")
        pieces = re.split("(" + "|".join(re.escape(str(p)) for p in pads) + ")", text)
        segments: list[Text | Image | Audio] = []
        remaining = list(media)
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if piece:
                    segments.append(Text(piece))
            elif not remaining or not isinstance(remaining[0], pads[piece]):
                raise ValueError("the chat template's media placeholders do not match the "
                                 "messages' image and audio parts")
            else:
                segments.append(remaining.pop(0))
        if remaining:
            raise ValueError(f"the chat template wrote no placeholder for {len(remaining)} of "
                             "the messages' image and audio parts")
        return Prompt(segments)

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                   *, add_generation_prompt: bool = True,
                   **template_kwargs: Any) -> GenerateResult:
        """Answer a conversation (``[{"role": "user", "content": "Hi"}, ...]``): `generate` on
        its `chat_prompt`, rendered in a worker thread (a template over a long conversation,
        the media parts' content digests: passes over every byte, kept off the event loop).
        `template_kwargs` reach the template (tools, documents, its own variables). Raises
        ValueError as `chat_prompt` does."""
        prompt = await trio.to_thread.run_sync(functools.partial(
            self.chat_prompt, messages, add_generation_prompt=add_generation_prompt,
            **template_kwargs))
        return await self.generate(prompt, params)

    def chat_stream(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                    *, add_generation_prompt: bool = True, **template_kwargs: Any) -> TokenStream:
        """`chat` as a `TokenStream` of token ids (see `stream`); the conversation is rendered
        here, in the caller's thread (render it with `chat_prompt` in a worker thread first
        where the caller is an event loop and the media are large)."""
        return self.stream(self.chat_prompt(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs), params)
