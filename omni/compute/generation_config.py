"""A checkpoint's `generation_config.json`: default sampling and EOS ids for requests.

Requests that pass no `SamplingParams` sample as the checkpoint asks, as SGLang does with
``--sampling-defaults model``, with transformers' reading of `do_sample`:

- `do_sample` false or absent (transformers' default): greedy (temperature 0); the sampling
  knobs below are then irrelevant, as in `model.generate()`.
- `do_sample` true: the file's `temperature`, `top_p`, `top_k` (0 = off), `min_p` and
  `repetition_penalty`; a knob the file leaves out keeps `SamplingParams`' (SGLang's) default,
  not transformers' own fallbacks (e.g. its top_k of 50).
- `max_new_tokens`, else `max_length` minus the prompt (at least 1 token, as transformers'
  length check); neither: `SamplingParams`' default (128 tokens, not transformers' legacy 20).
- `eos_token_id` (an id or a list) ends generation, as transformers' `generate` reads it
  (see `resolve_eos_token_ids` for a file without one).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni.compute.sampling_params import SamplingParams

__all__ = ["GENERATION_CONFIG_FILE", "GenerationDefaults", "load_generation_defaults",
           "resolve_eos_token_ids"]

GENERATION_CONFIG_FILE = "generation_config.json"
_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """The generation settings of a checkpoint (each None where the file leaves it out).

    Raises:
        ValueError: a setting of the wrong type, naming it.
    """

    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    max_length: int | None = None
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"{GENERATION_CONFIG_FILE}: do_sample must be a bool, "
                             f"got {self.do_sample!r}")
        for name in ("top_k", "max_new_tokens", "max_length"):
            _check(name, getattr(self, name), numbers.Integral)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check(name, getattr(self, name), numbers.Real)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationDefaults:
        """Read a `generation_config.json` dict (unknown keys are ignored, as transformers keeps
        them only for reference)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{GENERATION_CONFIG_FILE} is not a JSON object")
        eos = data.get("eos_token_id")
        eos_ids = None if eos is None else _token_ids(eos)
        values = {name: data.get(name) for name in (*_KNOBS, "max_new_tokens", "max_length")}
        do_sample = data.get("do_sample")
        return cls(do_sample=False if do_sample is None else do_sample, eos_token_ids=eos_ids,
                   **values)

    def sampling_params(self, num_prompt_tokens: int = 0) -> SamplingParams:
        """The `SamplingParams` of a request without its own, for a prompt of that length.

        Raises:
            ValueError: a setting `SamplingParams` refuses (e.g. top_p 1.5), naming the file.
        """
        kwargs: dict[str, Any] = {}
        if self.do_sample:
            kwargs = {k: getattr(self, k) for k in _KNOBS if getattr(self, k) is not None}
            if kwargs.get("top_k") == 0:  # transformers' "off"
                kwargs["top_k"] = -1
        else:
            kwargs["temperature"] = 0.0
            if self.repetition_penalty is not None:
                kwargs["repetition_penalty"] = self.repetition_penalty
        if self.max_new_tokens is not None:
            kwargs["max_new_tokens"] = self.max_new_tokens
        elif self.max_length is not None:
            kwargs["max_new_tokens"] = max(1, self.max_length - num_prompt_tokens)
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise ValueError(f"{GENERATION_CONFIG_FILE}: {exc}") from None


def load_generation_defaults(directory: str | Path) -> GenerationDefaults | None:
    """The `generation_config.json` of a checkpoint directory, or None when it has none.

    Raises:
        ValueError: a file that is not JSON or holds settings of the wrong type.
    """
    file = Path(directory) / GENERATION_CONFIG_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    return GenerationDefaults.from_dict(data)


def resolve_eos_token_ids(defaults: GenerationDefaults | None, config_eos: tuple[int, ...],
                          tokenizer_eos: int | None = None) -> tuple[int, ...]:
    """The ids that end generation: `generation_config.json`'s when it names any (as
    transformers' `generate`), else config.json's, else the tokenizer's `eos_token`.

    Where the file exists but names none, transformers would never stop at an EOS; falling
    back (as SGLang, which also reads config.json's) keeps such a checkpoint's answers finite.
    """
    if defaults is not None and defaults.eos_token_ids:
        return defaults.eos_token_ids
    if config_eos:
        return tuple(config_eos)
    return () if tokenizer_eos is None else (tokenizer_eos,)


def _check(name: str, value: object, kind: type) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        wanted = "an int" if kind is numbers.Integral else "a number"
        raise ValueError(f"{GENERATION_CONFIG_FILE}: {name} must be {wanted}, got {value!r}")


def _token_ids(value: object) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ValueError(f"{GENERATION_CONFIG_FILE}: eos_token_id must be a token id or a list "
                         f"of them, got {value!r}")
    return tuple(items)
