"""Frozen configs from mappings: what a YAML file or a Hydra group hands an engine.

One rule for every config dataclass that takes a mapping of its field names: None values keep the
defaults, an unknown name is an error naming it and listing the known ones, and a field's own
``ValueError`` comes back prefixed with where the caller wrote it (``policy.rel_margin: ...``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


def from_mapping(cls, values: Mapping[str, Any], where: str, convert: Mapping[str, Callable[[Any], Any]] = {},
                 moved: Mapping[str, str] = {}):
    """``cls(**values)`` for a frozen dataclass ``cls``; ``convert``: per field, a function applied to
    its value first; ``moved``: names that used to be fields here -> where they live now."""
    if not isinstance(values, Mapping):
        raise TypeError(f"{where}: expected a {cls.__name__} or a mapping of its fields, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for name in values:
        if name in moved:
            raise ValueError(f"{where}.{name}: moved to {moved[name]}")
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {names}")
    kwargs = {k: (convert[k](v) if k in convert else v) for k, v in values.items() if v is not None}
    try:
        return cls(**kwargs)
    except ValueError as e:  # name the field where the caller wrote it
        raise ValueError(f"{where}.{e}" if str(e).split(":")[0] in names else f"{where}: {e}") from None


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is an int to Python, never to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)
