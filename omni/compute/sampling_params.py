"""SGLang's `SamplingParams`: the same field names, defaults, meanings and valid ranges."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GREEDY_TEMPERATURE", "FinishReason", "SamplingParams"]

FinishReason = Literal["length", "stop"]
GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature samples greedily

# field -> (accepts the value?, the accepted range as the error message words it)
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "max_new_tokens": (lambda v: v >= 0, ">= 0"),
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda v: 0 < v <= 2, "in (0, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
}
_INT_FIELDS = frozenset({"max_new_tokens", "top_k", "seed"})


def _check_number(name: str, value: object, *, integral: bool) -> Any:
    """`value` as an int (integral) or a finite float; ValueError naming `name` otherwise."""
    kind, wanted = ("an int", numbers.Integral) if integral else ("a number", numbers.Real)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise ValueError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if integral:
        return int(value)  # type: ignore[call-overload]
    number = float(value) if abs(value) < 1e308 else math.inf  # type: ignore[arg-type, operator]
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def _as_tuple(value: object) -> tuple[Any, ...] | None:
    is_list = isinstance(value, Iterable) and not isinstance(value, str | bytes)
    return tuple(value) if is_list else None  # type: ignore[arg-type]


def _normalise_stop(stop: object) -> tuple[str, ...]:
    items = () if stop is None else (stop,) if isinstance(stop, str) else _as_tuple(stop)
    if items is None or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(dict.fromkeys(items))


def _normalise_token_ids(ids: object) -> frozenset[int]:
    items = () if ids is None else _as_tuple(ids)
    if items is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                and t >= 0 for t in items):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return frozenset(int(t) for t in items)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request samples: SGLang's `SamplingParams` fields, defaults and ranges.

    `max_new_tokens` >= 0; `temperature` >= 0 (below 1e-6: greedy); `top_p` in (0, 1] keeps the
    smallest set of tokens whose probability reaches it; `top_k` -1 (off) or >= 1; `min_p` in
    [0, 1] drops tokens less likely than min_p x the most likely; `repetition_penalty` in (0, 2]
    divides positive and multiplies negative logits of tokens in prompt or output;
    `frequency_penalty` / `presence_penalty` in [-2, 2] are subtracted per occurrence in the
    output / once; `stop` (stored as a tuple) and `stop_token_ids` (a frozenset; they apply even
    with `ignore_eos`) end the request; `seed` seeds the request's own generator.

    Raises:
        ValueError: a wrong type or a value out of range, naming the field and the range:
            ``top_p must be in (0, 1], got 1.5``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Collection[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    sampling_seed: int | None = None
    n: int = 1
    stop_regex: str | Sequence[str] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        for name, (accepts, accepted) in _RANGES.items():
            value = _check_number(name, getattr(self, name), integral=name in _INT_FIELDS)
            if not accepts(value):
                raise ValueError(f"{name} must be {accepted}, got {value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", _check_number("seed", self.seed, integral=True))
        if self.sampling_seed is not None:
            object.__setattr__(self, "sampling_seed",
                               _check_number("sampling_seed", self.sampling_seed, integral=True))
        if _check_number("n", self.n, integral=True) < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        if self.stream_interval is not None and _check_number(
                "stream_interval", self.stream_interval, integral=True) < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval!r}")
        stop_regex = self.stop_regex
        stop_regex = () if stop_regex is None else (
            (stop_regex,) if isinstance(stop_regex, str) else tuple(stop_regex))
        for pattern in stop_regex:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {exc}") from exc
        object.__setattr__(self, "stop_regex", stop_regex)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0 (< 1e-6) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, frequency or presence penalties is on."""
        return (self.repetition_penalty, self.frequency_penalty, self.presence_penalty) != (1, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (lists for `stop` and sorted `stop_token_ids`)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["stop"] = list(self.stop)  # type: ignore[arg-type]
        data["stop_token_ids"] = sorted(self.stop_token_ids)  # type: ignore[type-var]
        data["stop_regex"] = list(self.stop_regex)  # type: ignore[arg-type]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a dict such as `to_dict()` makes; ValueError names any unknown keys."""
        if not isinstance(data, Mapping):
            raise ValueError(f"SamplingParams.from_dict expects a mapping, got {data!r}")
        unknown = sorted(repr(k) for k in data if k not in _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        return cls(**data)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
