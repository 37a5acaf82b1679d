"""A request body checked against its pydantic model, every refusal naming the field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from omni.serve._errors import ApiError

__all__ = ["validated"]

M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], body: dict[str, Any], endpoint: str) -> M:
    """`body` as a `model`; `ApiError` 400 naming the first field that is unknown,
    unsupported or wrong. A field `model` lacks is refused unless it is null or false
    (which asks for nothing)."""
    served = set(model.model_fields)
    unsupported = sorted(k for k, v in body.items()
                         if k not in served and v is not None and v is not False)
    if unsupported:
        raise ApiError(400, f"{', '.join(unsupported)}: not supported by Omni's {endpoint}",
                       param=unsupported[0], code="unsupported_field")
    try:
        return model.model_validate({k: v for k, v in body.items() if k in served})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _where(body, first["loc"])
        message = (f"not supported by Omni's {endpoint}" if first["type"] == "extra_forbidden"
                   else first["msg"])
        raise ApiError(400, f"{where}: {message}", param=where) from None


def _where(body: Any, loc: tuple[Any, ...]) -> str:
    """The path of the field an error is about, as the request spells it: `loc` without
    the names pydantic adds for a union's branch (which are no keys of the body)."""
    path, value = [], body
    for i, key in enumerate(loc):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        elif not (i == len(loc) - 1 and isinstance(value, dict)):  # a missing field stays
            continue
        path.append(str(key))
    return ".".join(path)
