"""SGLang's `SamplingParams`: the same field names, defaults, `None` handling and valid ranges.

The accept/reject decisions are those of SGLang 0.5.23's `SamplingParams.__init__` ->
`normalize()` -> `verify(vocab_size)` (sglang/srt/sampling/sampling_params.py); the rows of
tests/compute/sglang_conformance.py pin each of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GREEDY_TEMPERATURE", "MAX_STOP_COUNT", "MAX_STOP_REGEX_BYTES", "FinishReason",
           "FrozenMapping", "SamplingParams"]

FinishReason = Literal["length", "stop"]
GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature samples greedily
MAX_STOP_COUNT = 32  # SGLang's MAX_STOP_COUNT, and MAX_STOP_REGEX_COUNT for stop_regex
MAX_STOP_REGEX_BYTES = 256  # SGLang's MAX_STOP_REGEX_LEN, in UTF-8 bytes
_SEED_RANGE = (-(2**63), 2**63 - 1)
_TOP_K_ALL = 1 << 30  # SGLang's TOP_K_ALL: top_k off

# field -> (default that None stands for, accepts the value?, the range as errors word it)
_NUMBERS: dict[str, tuple[float, Callable[[float], bool], str]] = {
    "temperature": (1.0, lambda v: v >= 0, ">= 0 (below 1e-6: greedy)"),
    "top_p": (1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "frequency_penalty": (0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "presence_penalty": (0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (1.0, lambda v: 0 < v <= 2, "in (0, 2]"),
}
_BOOLS = {"ignore_eos": False, "skip_special_tokens": True,
          "spaces_between_special_tokens": True, "no_stop_trim": False}
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
_UNSUPPORTED = frozenset({"beam_width", "watermark"})  # SGLang fields Omni does not serve
_REASONING_KEY = "__sglang_reasoning_end_token_ids"  # SGLang checks it in verify()


class FrozenMapping(Mapping[str, Any]):
    """A read-only dict for `logit_bias` and `custom_params`.

    Why: `SamplingParams` is frozen and hashable, and it crosses processes (pickle), which
    a `types.MappingProxyType` cannot do. Equal to a dict with the same items.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __hash__(self) -> int:
        return hash(json.dumps(self._data, sort_keys=True))


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


def _as_list(name: str, value: object) -> list[Any]:
    """A str as [str], None as [], any other iterable as a list; ValueError otherwise."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable) or isinstance(value, bytes | Mapping):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


def _normalise_strings(name: str, value: object) -> tuple[str, ...]:
    """`stop` / `stop_regex`: at most 32 non-empty strings (counted before duplicates go)."""
    items = _as_list(name, value)
    if len(items) > MAX_STOP_COUNT:
        raise ValueError(f"{name} must have at most {MAX_STOP_COUNT} entries, got {len(items)}")
    if not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return tuple(dict.fromkeys(items))


def _check_stop_regex(patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        size = len(pattern.encode("utf-8"))
        if size > MAX_STOP_REGEX_BYTES:
            raise ValueError(f"stop_regex must be at most {MAX_STOP_REGEX_BYTES} bytes "
                             f"(UTF-8), got {size}: {pattern!r}")
        try:
            re.compile(pattern)
        except (re.error, RecursionError) as exc:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {exc}") from exc


def _normalise_token_ids(ids: object) -> frozenset[int]:
    """SGLang's `{int(t) for t in ids if t is not None}`, for ints only."""
    if isinstance(ids, str | bytes | Mapping) or not (ids is None or isinstance(ids, Iterable)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
    items = [t for t in (ids or ()) if t is not None]  # type: ignore[attr-defined]
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
        raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
    return frozenset(int(t) for t in items)


def _token_key(key: object) -> int:
    """A logit_bias key as a token id: SGLang's `int(key)`, for str and int keys."""
    try:
        if isinstance(key, bool) or not isinstance(key, str | numbers.Integral):
            raise TypeError
        token_id = int(key)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids (ints or digit strings), "
                         f"got {key!r}") from None
    if token_id < 0:
        raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
    return token_id


def _normalise_logit_bias(bias: object) -> Mapping[str, float] | None:
    """{str(token id): bias}; the last of two keys naming one token wins, as in SGLang."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[str, float] = {}
    for key, value in bias.items():
        token_id = _token_key(key)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(
                value) or value == math.inf:
            raise ValueError(f"logit_bias[{key!r}] must be a finite number or -inf, "
                             f"got {value!r}")
        out.pop(str(token_id), None)
        out[str(token_id)] = float(value)
    return FrozenMapping(out)


def _is_json_scalar(value: object) -> bool:
    return value is None or isinstance(value, bool | int | str) or (
        isinstance(value, float) and math.isfinite(value))


def _normalise_custom_params(params: object) -> Mapping[str, Any] | None:
    """A JSON-safe copy: SGLang's CustomParamValue (scalar, list or str-keyed dict of them)."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ValueError(f"custom_params must be a dict with str keys, got {params!r}")
    for key, value in params.items():
        ok = _is_json_scalar(value) or (
            isinstance(value, list | tuple) and all(_is_json_scalar(v) for v in value)) or (
            isinstance(value, Mapping) and all(isinstance(k, str) and _is_json_scalar(v)
                                               for k, v in value.items()))
        if not ok:
            raise ValueError(f"custom_params[{key!r}] must be a JSON scalar, or a list or a "
                             f"str-keyed dict of them, got {value!r}")
    ids = params.get(_REASONING_KEY, [])
    if _REASONING_KEY in params and not (
            isinstance(ids, list | tuple) and 0 < len(ids) <= 32
            and all(type(t) is int and t >= 0 for t in ids)):
        raise ValueError(f"custom_params[{_REASONING_KEY!r}] must be a non-empty list of at "
                         f"most 32 token ids, got {ids!r}")
    return FrozenMapping(json.loads(json.dumps(dict(params))))


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request samples: SGLang's `SamplingParams` fields, defaults and ranges.

    `max_new_tokens` >= 0, or None: no limit of its own (the model's context ends the request);
    `min_new_tokens` in [0, max_new_tokens] masks EOS and `stop_token_ids` until reached;
    `temperature` >= 0 (below 1e-6: greedy, and `top_k` is then stored as 1, as SGLang does);
    `top_p` in (0, 1] keeps each token whose more likely tokens hold at most top_p of the mass;
    `top_k` -1 (off) or >= 1 keeps exactly the k most likely (ties: lower token id first);
    `min_p` in [0, 1] drops tokens less likely than min_p x the most likely;
    `repetition_penalty` in (0, 2] divides positive and multiplies negative logits of tokens in
    the output; `frequency_penalty` / `presence_penalty` in [-2, 2] are subtracted per
    occurrence in the output / once; `logit_bias` {token id string: bias} is added to the
    logits; `stop` / `stop_regex` (tuples, at most 32 each, regexes at most 256 bytes; found
    in SGLang's tail window of the output, `RequestSamplingState.stop_tail_ids`) and
    `stop_token_ids` (a frozenset) end the request, and `ignore_eos` ignores EOS and
    `stop_token_ids` alike (as SGLang); `n` samples per prompt; at most one of `json_schema`,
    `regex`, `ebnf`, `structural_tag` constrains the output; `skip_special_tokens`,
    `spaces_between_special_tokens`, `no_stop_trim` shape the text; `stream_interval` is the
    tokens per streamed chunk (None: the engine's); `sampling_seed` in [-2**63, 2**63 - 1]
    seeds the request's own generator; `custom_params` reaches a custom logit processor.

    `None` means the default for every field where SGLang says so (all but the strings and
    `logit_bias` / `custom_params` / `sampling_seed` / `stream_interval`, where None is "off").
    `verify(vocab_size)` adds SGLang's vocabulary checks. Where Omni is stricter than SGLang:

    | input | SGLang | Omni |
    | --- | --- | --- |
    | a bool for a number field, a float for an int field (`top_k=2.0`) | accepted | rejected |
    | a grammar that is not a string, a float `logit_bias` key (`5.0`) | accepted | rejected |
    | `n` < 1, `stream_interval` < 1 | not checked | rejected |
    | an empty string in `stop` / `stop_regex` | accepted (ends at once) | rejected |
    | a `stop_regex` `re.compile` rejects but `sre_parse` parses | accepted | rejected |
    | `stop_token_ids` entries that are not ints (`"3"`, `3.0`, `True`) | `int(t)` | rejected |
    | a NaN or +inf `logit_bias` value | accepted (NaN logits) | rejected |
    | a non-bool for `ignore_eos` and the other flags | truthiness | rejected |
    | `custom_params` not a str-keyed dict of SGLang's CustomParamValue | not checked | rejected |
    | `beam_width`, `watermark` (in `from_dict`) | served | rejected as unsupported |

    Raises:
        ValueError: a wrong type or a value out of range, naming the field and the range:
            ``top_p must be in (0, 1], got 1.5``.
    """

    max_new_tokens: int | None = 128
    stop: str | Sequence[str] | None = None
    stop_token_ids: Collection[int] | None = None
    stop_regex: str | Sequence[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: Mapping[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self._set_numbers()
        self._set_lengths()
        self._set("stop", _normalise_strings("stop", self.stop))
        self._set("stop_regex", _normalise_strings("stop_regex", self.stop_regex))
        _check_stop_regex(self.stop_regex)  # type: ignore[arg-type]
        self._set("stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        self._set_flags_and_grammars()
        self._set("logit_bias", _normalise_logit_bias(self.logit_bias))
        self._set("custom_params", _normalise_custom_params(self.custom_params))
        if self.sampling_seed is not None:
            seed = _check_number("sampling_seed", self.sampling_seed, integral=True)
            if not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
                raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}")
            self._set("sampling_seed", seed)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _set_numbers(self) -> None:
        for name, (default, accepts, accepted) in _NUMBERS.items():
            raw = getattr(self, name)
            value = default if raw is None else _check_number(name, raw, integral=False)
            if not accepts(value):
                raise ValueError(f"{name} must be {accepted}, got {value!r}")
            self._set(name, value)
        top_k = -1 if self.top_k is None else _check_number("top_k", self.top_k, integral=True)
        if self.temperature < GREEDY_TEMPERATURE:
            top_k = 1  # SGLang turns near-zero temperature into top_k = 1 before verify()
        elif not (top_k == -1 or top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k!r}")
        elif top_k == _TOP_K_ALL:
            top_k = -1  # SGLang's own spelling of "off"
        self._set("top_k", top_k)

    def _set_lengths(self) -> None:
        limit = self.max_new_tokens
        if limit is not None:
            limit = _check_number("max_new_tokens", limit, integral=True)
            if limit < 0:
                raise ValueError(f"max_new_tokens must be >= 0 or None, got {limit}")
        minimum = 0 if self.min_new_tokens is None else _check_number(
            "min_new_tokens", self.min_new_tokens, integral=True)
        if minimum < 0 or (limit is not None and minimum > limit):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens ({limit})], "
                             f"got {minimum}")
        n = 1 if self.n is None else _check_number("n", self.n, integral=True)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        interval = self.stream_interval
        if interval is not None:
            interval = _check_number("stream_interval", interval, integral=True)
            if interval < 1:
                raise ValueError(f"stream_interval must be >= 1 or None, got {interval}")
        for name, value in (("max_new_tokens", limit), ("min_new_tokens", minimum), ("n", n),
                            ("stream_interval", interval)):
            self._set(name, value)

    def _set_flags_and_grammars(self) -> None:
        for name, default in _BOOLS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            self._set(name, default if value is None else value)
        for name in _GRAMMARS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
            self._set(name, value or None)  # SGLang: an empty grammar means "unset"
        set_grammars = [name for name in _GRAMMARS if getattr(self, name) is not None]
        if len(set_grammars) > 1:
            raise ValueError(f"only one of json_schema, regex, ebnf, structural_tag can be "
                             f"set, got {', '.join(set_grammars)}")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0 (< 1e-6) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, frequency or presence penalties is on."""
        return (self.repetition_penalty, self.frequency_penalty, self.presence_penalty) != (1, 0, 0)

    @property
    def filters(self) -> bool:
        """True when top-k, top-p or min-p is on (SGLang's sampler then filters the row)."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as (field name, value), or None when the output is free."""
        return next(((n, getattr(self, n)) for n in _GRAMMARS if getattr(self, n)), None)

    def verify(self, vocab_size: int) -> SamplingParams:
        """SGLang's vocabulary checks: `logit_bias` keys (and reasoning ids) < vocab_size.

        Returns self. Raises ValueError naming the first token id outside [0, vocab_size).
        """
        ids = [int(k) for k in self.logit_bias or {}]
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be in [0, {vocab_size - 1}], got {bad[0]}")
        reasoning = (self.custom_params or {}).get(_REASONING_KEY, [])
        if any(t >= vocab_size for t in reasoning):
            raise ValueError(f"custom_params[{_REASONING_KEY!r}] must be token ids in "
                             f"[0, {vocab_size - 1}], got {reasoning!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict: lists for `stop`, `stop_regex` and sorted `stop_token_ids`."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["stop"], data["stop_regex"] = list(self.stop), list(self.stop_regex)  # type: ignore
        data["stop_token_ids"] = sorted(self.stop_token_ids)  # type: ignore[type-var]
        for name in ("logit_bias", "custom_params"):
            value = data[name]
            data[name] = None if value is None else json.loads(json.dumps(dict(value)))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a dict such as `to_dict()` or an SGLang request makes.

        Raises ValueError naming unknown keys (`seed` is SGLang's `sampling_seed`) and the
        SGLang fields Omni does not serve.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"SamplingParams.from_dict expects a mapping, got {data!r}")
        if "seed" in data:
            raise ValueError("unknown SamplingParams field 'seed': SGLang's name for the "
                             "sampling seed is 'sampling_seed'")
        unsupported = sorted(repr(k) for k in data if k in _UNSUPPORTED)
        if unsupported:
            raise ValueError(f"SGLang field(s) Omni does not support: {', '.join(unsupported)}")
        unknown = sorted(repr(k) for k in data if k not in _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        return cls(**data)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
