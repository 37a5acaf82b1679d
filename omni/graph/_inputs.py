"""A graph's inputs from outside Python (JSON on the command line, a request body) converted to
the types its parameters are annotated with, or refused with the input's name.

Why msgspec: it converts JSON values to annotated types (dataclasses from objects, tuples from
arrays, ``Literal``, ``Optional``, constraints in ``Annotated[int, Meta(ge=0)]``) strictly, and
says where a value does not fit (``$[1]``, ``$.field``). A type it cannot build from JSON (a
tensor, an array, an iterator) is accepted as an instance of itself only; ``Path``\\s come from
strings. An input without an annotation, or annotated ``Any``, is taken as given.
"""

from __future__ import annotations

import inspect
import pathlib
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from omni.graph.errors import InputError

if TYPE_CHECKING:
    from omni.graph.dsl import GraphInput

__all__ = ["convert_inputs", "input_converters"]

Converter = Callable[[Any], Any]


def _from_json(target: Any, value: Any) -> Any:
    """msgspec's hook for types it does not know: an instance passes, a Path comes from text."""
    cls = typing.get_origin(target) or target
    if isinstance(cls, type):
        if isinstance(value, cls):
            return value
        if issubclass(cls, pathlib.PurePath) and isinstance(value, str):
            return cls(value)
    name = getattr(cls, "__qualname__", None) or repr(cls)
    raise msgspec.ValidationError(f"Expected `{name}`, got `{type(value).__name__}`")


def _converter(annotation: Any) -> Converter | None:
    """How to convert a value to `annotation`; None: take values as they are."""
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return None
    try:
        msgspec.json.Decoder(annotation, dec_hook=_from_json)  # a type msgspec understands
    except (TypeError, ValueError):
        return None
    return lambda value: msgspec.convert(value, annotation, dec_hook=_from_json)


def input_converters(inputs: Sequence[GraphInput]) -> dict[str, Converter]:
    """A converter for each input that has one (see `_converter`)."""
    converters = {}
    for graph_input in inputs:
        convert = _converter(graph_input.type)
        if convert is not None:
            converters[graph_input.name] = convert
    return converters


def convert_inputs(graph_name: str, converters: Mapping[str, Converter],
                   values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with each converted by its input's converter.

    Raises:
        InputError: a value that does not fit its input's type, naming the input and where in
            the value (``input 'turns[2].text'``).
    """
    converted = dict(values)
    for name, value in values.items():
        convert = converters.get(name)
        if convert is None:
            continue
        try:
            converted[name] = convert(value)
        except msgspec.ValidationError as exc:
            raise InputError(f"graph '{graph_name}': input {_where(name, str(exc))}") from None
    return converted


def _where(name: str, message: str) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$[1]``` as ``'n[1]': expected ...``."""
    message, _, path = message.partition(" - at `")
    where = name + path.rstrip("`").removeprefix("$")
    return f"'{where}': {message[:1].lower()}{message[1:]}"
