"""Run a model in SGLang's engine with Omni's `SamplingParams` (the `sglang` extra).

SGLang brings its own CUDA kernels, scheduler and radix prefix cache; this adapter only
translates: Omni's sampling parameters to SGLang's (same names, same meanings), SGLang's
result to a `GenerateResult` with the prompt tokens its cache served (`cached_tokens`).
SGLang is asyncio-based, so its engine lives on an asyncio loop in a thread of its own and
trio code awaits its results without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

from omni.compute.engine import GenerateResult
from omni.compute.sampling import SamplingParams

__all__ = ["SGLangEngine", "to_sglang_params"]

INSTALL_HINT = "the SGLang backend needs the 'sglang' extra: pip install 'omni[sglang]'"


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return sglang


def to_sglang_params(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for `params`: every field, under the same name.

    SGLang's `SamplingParams(**d)` -> `normalize()` -> `verify(vocab_size)` accepts the result
    of every `SamplingParams` Omni accepts (that passes its own `verify(vocab_size)`).
    """
    out = params.to_dict()
    for name in ("stop", "stop_regex", "stop_token_ids"):
        if not out[name]:
            del out[name]  # SGLang's default (None)
    return out


def from_sglang_output(output: dict[str, Any]) -> GenerateResult:
    """A `GenerateResult` from one SGLang ``generate`` output."""
    meta = output.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    return GenerateResult(
        token_ids=list(output.get("output_ids", [])),
        text=output.get("text"),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        finish_reason="length" if reason == "length" else "stop",
        time_to_first_token=math.nan,  # not reported by SGLang's non-streaming call
    )


class SGLangEngine:
    """A model served by SGLang (``sglang.Engine(model_path=..., **engine_args)``).

    Raises:
        ImportError: sglang is not installed (the message names the extra).
    """

    def __init__(self, model_path: str, **engine_args: Any):
        sglang = _import_sglang()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-sglang",
                                        daemon=True)
        self._thread.start()
        created = asyncio.run_coroutine_threadsafe(
            self._create(sglang, model_path, engine_args), self._loop)
        self._engine = created.result()

    @staticmethod
    async def _create(sglang: Any, model_path: str, engine_args: dict[str, Any]) -> Any:
        return sglang.Engine(model_path=model_path, **engine_args)

    async def generate(self, prompt: str | list[int],
                       params: SamplingParams | None = None) -> GenerateResult:
        """Generate with SGLang; `cached_tokens` counts the prompt tokens its cache served."""
        import trio

        params = params if params is not None else SamplingParams()
        key = "prompt" if isinstance(prompt, str) else "input_ids"
        coro = self._engine.async_generate(**{key: prompt},
                                           sampling_params=to_sglang_params(params))
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        output = await trio.to_thread.run_sync(future.result)
        return from_sglang_output(output)

    def shutdown(self) -> None:
        """Stop SGLang's engine and its loop thread."""
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
