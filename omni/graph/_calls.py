"""What a traced graph body records: node calls and the pseudo-nodes of ``ref[key]`` and
`omni.switch`. Plain records, apart from `dsl.py` so that the validator and the plan compiler
read them without importing the DSL that uses both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni.graph._node import Ref

if TYPE_CHECKING:
    from omni.graph.dsl import Graph

__all__ = ["Call", "GetItem", "SwitchSpec"]


@dataclass
class Call:
    """One node call recorded in a trace; `slot` is where its value lives in a request."""

    slot: int
    name: str
    target: Any  # Node | SwitchSpec | GetItem
    args: tuple
    kwargs: dict[str, Any]
    location: str
    ref: Ref | None = None


@dataclass(frozen=True)
class GetItem:
    """The pseudo-node behind ``ref[key]``."""

    key: Any


@dataclass(frozen=True)
class SwitchSpec:
    """The pseudo-node behind `omni.switch`: a selector and one sub-graph per value."""

    branches: Mapping[Any, Graph]
    streaming: bool
    type: Any
