"""An image graph for the tenant tests: its "PNG" is the cache salt the route gave it, so a
test reads which salt a request of each tenant ran under."""

from __future__ import annotations

from typing import Annotated

import omni
from omni.serve.openai import image_generations


@omni.node
async def salt_as_png(prompt: str, cache_salt: str) -> dict:
    return {"png": f"{prompt}|{cache_salt}".encode()}


@image_generations
@omni.graph
def salted(prompt: str, out: str = "", width: int = 16, height: int = 16, seed: int = 0,
           png: bool = True, cache_salt: Annotated[str, omni.CacheSalt()] = ""):
    return salt_as_png(prompt, cache_salt)
