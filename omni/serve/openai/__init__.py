"""OpenAI's endpoints for the graphs that declare them.

A graph file marks a graph with `chat_completions` or `image_generations` above
``@omni.graph``; ``omni serve`` then answers ``POST /v1/chat/completions`` or
``POST /v1/images/generations`` with it (the request's ``model`` is the graph's name), so
applications reach it with the official ``openai`` client; an image graph whose ``image``
input takes an `ImagePart` answers ``POST /v1/images/edits`` too. Importing this package does
not import torch.
"""

from omni.serve.openai._chat_request import ChatPolicy
from omni.serve.openai._declare import (
    CHAT_COMPLETIONS,
    IMAGE_GENERATIONS,
    AudioPart,
    ChatAudio,
    ChatEnd,
    ChatMessage,
    ChatRequest,
    ChatStart,
    ChatText,
    ImagePart,
    chat_completions,
    endpoint_of,
    image_generations,
)
from omni.serve.openai._media import MediaPolicy
from omni.serve.openai._routes import add_openai_routes

__all__ = ["CHAT_COMPLETIONS", "IMAGE_GENERATIONS", "AudioPart", "ChatAudio", "ChatEnd",
           "ChatMessage", "ChatPolicy", "ChatRequest", "ChatStart", "ChatText", "ImagePart",
           "MediaPolicy", "add_openai_routes", "chat_completions", "endpoint_of",
           "image_generations"]
