"""Serving: graphs over HTTP, the way applications reach every other model server.

`build_app` makes the ASGI app (``/v1/graphs/{name}``, ``/v1/models``, ``/health``,
``/metrics``, ``/docs``), `serve` runs it (hypercorn's HTTP protocol on trio) until told to
stop, then drains: new requests get 503, those in flight may finish up to a timeout, the rest
are cut and told so; ``omni serve FILE`` is the command that does both.
"""

from omni.serve._errors import ApiError
from omni.serve._files import FilePolicy
from omni.serve._guard import GuardState
from omni.serve.app import build_app
from omni.serve.openai import ChatPolicy, MediaPolicy
from omni.serve.server import DRAIN_TIMEOUT_S, serve

__all__ = ["DRAIN_TIMEOUT_S", "ApiError", "ChatPolicy", "FilePolicy", "GuardState",
           "MediaPolicy", "build_app", "serve"]
