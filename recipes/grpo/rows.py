"""A user's own prompts: rows from a local JSONL / Parquet file or a saved ``datasets`` folder.

A row is a plain dict (nested dicts and lists allowed). ``data.prompt_key`` and ``data.label_key``
are dotted paths into it (``meta.answer``, ``turns.0.text``); every row is checked when the file is
read, so a missing key is a ``DataRowError`` naming the file, the row and the key before any
training work starts. Nothing is downloaded: ``datasets`` only reads what is on disk.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any, Sequence

_MISSING = object()


class DataRowError(ValueError):
    """A row lacks a configured key, or holds a value of the wrong kind there."""


class EmptySplitError(ValueError):
    """A split that a run needs (train or eval) has no rows."""


def get_path(row: Any, path: str, default: Any = _MISSING) -> Any:
    """``row`` followed along the dotted ``path`` (dict keys; integer parts index lists)."""
    value = row
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            if default is not _MISSING:
                return default
            raise KeyError(path)
    return value


def read_rows(path: str) -> list[dict[str, Any]]:
    """Every row of ``path``: ``.jsonl`` / ``.json`` (one object a line), ``.parquet``, or a folder
    written by ``datasets.Dataset.save_to_disk`` (or holding data files ``datasets`` can read)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data.path: {path!r} does not exist")
    if os.path.isdir(path):
        import datasets

        if os.path.isfile(os.path.join(path, "dataset_info.json")) or os.path.isfile(os.path.join(path, "state.json")):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"data.path: {path!r} is a DatasetDict without a 'train' split "
                                     f"(has {sorted(ds)}); point data.path at one split's folder")
                ds = ds["train"]
        else:
            ds = datasets.load_dataset(path, split="train")
        return [dict(r) for r in ds]
    if path.endswith(".parquet"):
        import datasets

        return [dict(r) for r in datasets.Dataset.from_parquet(path)]
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataRowError(f"{path}:{line_no}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataRowError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    raise ValueError(f"data.path: {path!r}: expected a .jsonl, .json or .parquet file or a datasets folder")


def check_rows(rows: Sequence[tuple[int, dict[str, Any]]], keys: dict[str, str | None], source: str) -> None:
    """Every (row number in its source, row) has every configured key (``{"data.prompt_key":
    "messages", ...}``; None: unused)."""
    for i, row in rows:
        for option, key in keys.items():
            if key is None:
                continue
            if get_path(row, key, None) is None:
                have = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DataRowError(f"{source}: row {i} has no {key!r} ({option}); its keys: {have}")


def split_rows(rows: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded ``eval_fraction`` of ``rows`` held out (at least one row when > 0),
    both in their original order."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction: expected in [0, 1), got {eval_fraction}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = 0 if eval_fraction == 0 else max(1, round(eval_fraction * len(rows)))
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
