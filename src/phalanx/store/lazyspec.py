"""A job's spec in a node-work row, decoded only when something reads it.

Every heartbeat reads the node's work (store._NODE_WORK, steps._node_step_work_query): a row
per live task, each with its job's spec, whose script and exported environment run to
kilobytes. Only a task being started needs it (launch.build_launch); the rest of the
exchange reads the task's states, tokens and the one spec field it tests on every row, the
periodic checkpoint interval, which the queries select on its own (`checkpoint_interval_s`).
Decoding every spec on every heartbeat was most of the JSON decoding of a placements run, the
largest single cost of the read.

The queries select the column cast to text (a no-op on SQLite; on PostgreSQL it keeps
psycopg from decoding the json column itself, which it did for every live task on every
heartbeat), and `LazySpec` keeps the text until first use. It reads as a read-only mapping.
It is not a dict: serializing one raises instead of writing `{}`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from phalanx.store.jsoncol import json_loads


class LazySpec(Mapping[str, Any]):
    """A JSON object kept as its text until a key, its length or its items are asked for."""

    __slots__ = ("_data", "_raw")

    def __init__(self, raw: str) -> None:
        self._raw = raw
        self._data: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            data = json_loads(self._raw)
            if not isinstance(data, dict):
                raise TypeError(f"a job spec must be a JSON object, not {type(data).__name__}")
            self._data = data
        return self._data

    @property
    def decoded(self) -> bool:
        """Whether the text has been decoded (for tests of the laziness itself)."""
        return self._data is not None

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._load().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __bool__(self) -> bool:
        # a submitted spec is never empty: `spec or {}` need not decode it
        return self._raw != "{}" if self._data is None else bool(self._data)

    def __repr__(self) -> str:
        return f"LazySpec({self._load()!r})"


class LazySpecColumn(TypeDecorator[Any]):
    """Selects a JSON column as its text and gives it back as a `LazySpec` (a value the driver
    has already decoded, on PostgreSQL, passes through)."""

    impl = Text
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return LazySpec(value) if isinstance(value, str) else value
