"""Typed, range-checked reads of fields from parsed JSON (plans, profiles), one-line errors.

    from lengthwise.fields import Fields
    f = Fields(d, "plan.json pipeline 3")
    tp = f.integer("tp", lo=1, default=1)           # "plan.json pipeline 3: field tp must be an integer >= 1, got '2'"
    coef = f.numbers("fwd", count=3)            # three finite numbers >= 0

JSON readers call these before building dataclasses, so a wrong type (`"zero": null`,
`"tp": "2"`), a value out of range (`"cp": 0`), a non-finite number or an array of the wrong
length is a `UserError` naming the file, the place and the field, never a traceback deep in a
planner or the simulator. Booleans are not integers here (JSON `true` is not `1`).
"""

from __future__ import annotations

import math
from typing import Any

from lengthwise.errors import UserError
from lengthwise.limits import MAX_LENGTH  # noqa: F401  (readers import it from here)


_MISSING = object()


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Fields:
    """Reads fields of one JSON object; `where` names it in every error."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected a JSON object, got {_describe(data)}")
        self.data, self.where = data, where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise UserError(f"{self.where}: field {key} is missing")
        return default

    def fail(self, key: str, wanted: str, value: Any) -> UserError:
        return UserError(f"{self.where}: field {key} must be {wanted}, got {_describe(value)}")

    def integer(self, key: str, *, lo: int | None = None, hi: int | None = None, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(key, _int_range(lo, hi), value)
        return value

    def number(self, key: str, *, lo: float | None = 0.0, default: Any = _MISSING) -> float:
        """A finite number >= lo (lo None: any finite number)."""
        value = self._get(key, default)
        if not is_number(value) or (lo is not None and value < lo):
            raise self.fail(key, "a finite number" + ("" if lo is None else f" >= {lo:g}"), value)
        return float(value)

    def optional_number(self, key: str, *, lo: float | None = 0.0) -> float | None:
        return None if self.data.get(key) is None else self.number(key, lo=lo)

    def string(self, key: str, *, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        return value

    def boolean(self, key: str, *, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def mapping(self, key: str, *, default: Any = _MISSING) -> dict:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.fail(key, "a JSON object", value)
        return value

    def array(self, key: str, *, item: str = "any", min_len: int = 0, default: Any = _MISSING) -> list:
        """A list whose items are all of kind `item` ("any", "str" or "dict")."""
        value = self._get(key, default)
        kinds = {"any": object, "str": str, "dict": dict}
        if not isinstance(value, list) or len(value) < min_len:
            raise self.fail(key, "a list" + (f" of at least {min_len}" if min_len else ""), value)
        bad = next((x for x in value if not isinstance(x, kinds[item])), _MISSING)
        if bad is not _MISSING:
            raise self.fail(key, f"a list of {item}s", bad)
        return value

    def ints(self, key: str, *, lo: int, hi: int, min_len: int = 0, default: Any = _MISSING) -> list[int]:
        values = self.array(key, min_len=min_len, default=default)
        for i, v in enumerate(values):
            if not is_int(v) or not lo <= v <= hi:
                raise UserError(f"{self.where}: {key}[{i}] must be {_int_range(lo, hi)}, got {_describe(v)}")
        return values

    def numbers(self, key: str, *, count: int, lo: float | None = 0.0, default: Any = _MISSING) -> tuple[float, ...]:
        """Exactly `count` finite numbers, each >= lo."""
        values = self._get(key, default)
        if not isinstance(values, (list, tuple)) or len(values) != count:
            raise self.fail(key, f"a list of {count} numbers", values)
        for i, v in enumerate(values):
            if not is_number(v) or (lo is not None and v < lo):
                raise UserError(f"{self.where}: {key}[{i}] must be a finite number"
                                + ("" if lo is None else f" >= {lo:g}") + f", got {_describe(v)}")
        return tuple(float(v) for v in values)

    def only(self, allowed: set[str] | list[str] | tuple[str, ...]) -> None:
        """No field outside `allowed` (a typo would otherwise be ignored silently)."""
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise UserError(f"{self.where}: unknown field {unknown[0]} (fields: {', '.join(sorted(allowed))})")


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo is not None:
        return f"an integer >= {lo}"
    return "an integer" if hi is None else f"an integer <= {hi}"


def check_spec_fields(cls: type, data: Any, where: str, ranges: dict[str, tuple[float, float]]) -> dict:
    """The fields of a specs dataclass (ModelSpec, ClusterSpec) checked against their annotated
    types (int, float, str, bool; numbers finite) and `ranges` (name -> inclusive lo, hi)."""
    f = Fields(data, where)
    types = {name: str(t) for name, t in cls.__annotations__.items()}
    f.only(types)
    for key, kind in types.items():
        if key not in f.data:
            continue
        lo, hi = ranges.get(key, (None, None))
        if kind == "int":
            f.integer(key, lo=lo, hi=hi)
        elif kind == "float":
            value = f.number(key, lo=lo)
            if hi is not None and value > hi:
                raise f.fail(key, f"a number in [{lo:g}, {hi:g}]", value)
        elif kind == "str":
            f.string(key)
        elif kind == "bool":
            f.boolean(key)
    return f.data


POSITIVE_OPTIONS = ("chunk_size", "k", "micro_batch_size", "bucket_size", "num_slices", "num_micropacks",
                    "pack_tokens")
"""Recorded planner options that are counts or sizes: when a number, at least 1."""


def check_recorded_options(options: dict, where: str) -> dict:
    """A plan's recorded planner options: no negative number anywhere in them (every option is
    a size, a count, a threshold or a time), and sizes at least 1."""
    for path, value in _numbers_in(options, "options"):
        name = path.rsplit(".", 1)[-1]
        if value < 0 or (name in POSITIVE_OPTIONS and value < 1):
            least = 1 if name in POSITIVE_OPTIONS else 0
            raise UserError(f"{where}: {path} is {value}, but it must be at least {least}: plan the batch again")
    return options


def _numbers_in(data, path: str):
    """(dotted path, number) of every number inside nested JSON objects and lists."""
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path, data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers_in(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _numbers_in(value, f"{path}[{i}]")
