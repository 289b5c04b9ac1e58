"""The run's prompts, whatever their source: train / eval / SFT examples as token ids plus their row.

``data.kind`` picks the source:

* ``arith_chain``: the built-in generator (recipes/grpo/data.py), seeded; no eval split unless
  ``data.eval_size > 0``.
* ``file``: a user's JSONL / Parquet / ``datasets`` folder (recipes/grpo/rows.py), with
  ``data.eval_path`` or a seeded ``data.eval_fraction`` held out.
* ``reasoning_gym``: ``reasoning_gym.create_dataset(data.task, ...)``, procedural tasks with their own
  verifiers (the ``reasoning-gym`` extra), offline.

A prompt is a string or a list of chat messages; ``data.chat_template`` decides how it becomes ids
(``auto``: messages through the tokenizer's chat template, strings as they are; ``always``: a string
becomes one user message first; ``never``: strings only). Prompts longer than ``max_prompt_len``
are dropped and counted (``data/overlong_filtered/<split>``) instead of failing a step later.
The ids built here are handed to the engine as they are and scored by the trainer as they are.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from splash_rollout.recipes.grpo.data import ChainTaskConfig, make_dataset, without_answer
from splash_rollout.recipes.grpo.rows import DataRowError, EmptySplitError, check_rows, get_path, read_rows, split_rows

CHAT_MODES = ("auto", "always", "never")
KINDS = ("arith_chain", "file", "reasoning_gym")


@dataclass(frozen=True)
class DataOptions:
    """The recipe's ``data`` group, typed (``recipes/grpo/build.data_options`` makes it). Each source
    reads its own keys; its YAML (``conf/data/<kind>.yaml``) lists them with their defaults and what
    they mean, so the keys every source has are required here and the others default to None (a key
    another source reads)."""

    kind: str
    """The source: ``arith_chain``, ``file`` or ``reasoning_gym``."""
    prompt_key: str
    chat_template: str
    shuffle: bool
    seed: int
    label_key: str | None = None
    sft_key: str | None = None
    max_prompt_len: int | None = None
    task: Any = None
    """``arith_chain``: the generator's ``ChainTaskConfig`` fields (a mapping); ``reasoning_gym``: the task name."""
    eval_size: int | None = None
    sft_seed: int | None = None
    sft_answer_marked: float | None = None
    grpo_seed: int | None = None
    grpo_pool_size: int | None = None
    eval_seed: int | None = None
    path: str | None = None
    eval_path: str | None = None
    eval_fraction: float | None = None
    task_config: dict | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if self.chat_template not in CHAT_MODES:
            raise ValueError(f"chat_template: expected one of {CHAT_MODES}, got {self.chat_template!r}")
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"shuffle: expected True or False, got {self.shuffle!r}")


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    """[num_prompt_tokens] exactly what the engine is given."""
    row: dict[str, Any]
    """The source row as read (what a reward function receives)."""
    label: Any
    """The row's value at ``data.label_key`` (None when no key is configured)."""
    target: str | None = None
    """SFT target text at ``data.sft_key`` (the reference response), when configured."""
    split: str = "train"
    index: int = 0
    """The row's position in its source (file line order), for error messages."""


@dataclass
class TaskData:
    train: list[Example]
    eval: list[Example]
    sft: list[Example]
    filtered: dict[str, int] = field(default_factory=dict)
    """Overlong prompts dropped per split (``train``, ``eval``)."""

    def metrics(self) -> dict[str, float]:
        out = {f"data/overlong_filtered/{k}": float(v) for k, v in sorted(self.filtered.items())}
        out.update({"data/train_rows": float(len(self.train)), "data/eval_rows": float(len(self.eval))})
        return out


def render_prompt(prompt: Any, tokenizer, chat_template: str) -> list[int]:
    """[num_prompt_tokens] ids of one prompt (a string or chat messages) under ``chat_template``."""
    if chat_template not in CHAT_MODES:
        raise ValueError(f"data.chat_template: expected one of {CHAT_MODES}, got {chat_template!r}")
    if isinstance(prompt, str):
        if chat_template == "always":
            return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)
    if chat_template == "never":
        raise DataRowError(f"data.chat_template=never, but a prompt is {type(prompt).__name__}, not a string")
    return tokenizer.apply_chat_template(prompt)


def _examples(rows: list[tuple[int, dict]], source: str, split: str, d: DataOptions, tokenizer,
              max_prompt_len: int | None) -> tuple[list[Example], int]:
    out, dropped = [], 0
    for i, row in rows:
        try:
            ids = render_prompt(get_path(row, d.prompt_key), tokenizer, d.chat_template)
        except (DataRowError, ValueError) as e:
            raise DataRowError(f"{source}: row {i}, {d.prompt_key!r} (data.prompt_key): {e}") from None
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            dropped += 1
            continue
        label = get_path(row, d.label_key) if d.label_key else None
        target = get_path(row, d.sft_key) if d.sft_key else None
        if target is not None and not isinstance(target, str):
            raise DataRowError(f"{source}: row {i}, {d.sft_key!r} (data.sft_key): expected a string, "
                               f"got {type(target).__name__}")
        out.append(Example(ids, row, label, target, split, i))
    return out, dropped


def _numbered(rows: list[dict]) -> list[tuple[int, dict]]:
    return list(enumerate(rows))


def _source_rows(d: DataOptions, fresh_prompts: int) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]], str, str]:
    """(train rows, eval rows, train source name, eval source name) of ``data.kind``; each row
    paired with its number in its source."""
    kind = d.kind
    if kind == "arith_chain":
        task = ChainTaskConfig(**dict(d.task or {}))
        train = _numbered(list(make_dataset(d.grpo_pool_size or fresh_prompts, d.grpo_seed, task)))
        evals = _numbered(list(make_dataset(d.eval_size, d.eval_seed, task))) if d.eval_size else []
        return train, evals, "arith_chain", "arith_chain (eval)"
    if kind == "reasoning_gym":
        try:
            import reasoning_gym
        except ImportError:
            raise ImportError("data=reasoning_gym needs the reasoning-gym package: "
                              "pip install 'splash_rollout[reasoning-gym]'") from None
        extra = dict(d.task_config or {})
        make = lambda size, seed: _numbered([dict(e) for e in reasoning_gym.create_dataset(d.task, size=size,
                                                                                             seed=seed, **extra)])
        return make(d.size, d.seed), (make(d.eval_size, d.seed + 1) if d.eval_size else []), \
            f"reasoning_gym:{d.task}", f"reasoning_gym:{d.task} (eval)"
    if kind == "file":
        if not d.path:
            raise ValueError("data=file needs data.path (a .jsonl / .parquet file or a datasets folder)")
        rows = _numbered(read_rows(d.path))
        if d.eval_path:
            return rows, _numbered(read_rows(d.eval_path)), d.path, f"data.eval_path={d.eval_path}"
        train, evals = split_rows(rows, float(d.eval_fraction or 0.0), int(d.seed))
        return train, evals, d.path, f"{d.path} (held-out {d.eval_fraction})"
    raise ValueError(f"data.kind: expected arith_chain, file or reasoning_gym, got {kind!r}")


def build_task_data(d: DataOptions, tokenizer, max_prompt_len: int | None, need_eval: bool,
                    sft_examples: int = 0, fresh_prompts: int = 0) -> TaskData:
    """Read, check and tokenize every split. Raises (before any training work) on a missing key,
    an empty train split, or an empty eval split when ``need_eval``. ``sft_examples``: how many SFT
    rows the run consumes; ``fresh_prompts``: the generator's pool when ``data.grpo_pool_size`` is null."""
    train_rows, eval_rows, train_src, eval_src = _source_rows(d, fresh_prompts)
    keys = {"data.prompt_key": d.prompt_key, "data.label_key": d.label_key}
    check_rows(train_rows, {**keys, "data.sft_key": d.sft_key if sft_examples else None}, train_src)
    check_rows(eval_rows, keys, eval_src)
    train, dropped_train = _examples(train_rows, train_src, "train", d, tokenizer, max_prompt_len)
    evals, dropped_eval = _examples(eval_rows, eval_src, "eval", d, tokenizer, max_prompt_len)
    if not train:
        raise EmptySplitError(f"{train_src}: no train rows left ({len(train_rows)} read, {dropped_train} longer "
                              f"than max_prompt_len={max_prompt_len})")
    if need_eval and not evals:
        raise EmptySplitError(f"{eval_src}: the eval split is empty ({len(eval_rows)} rows read, {dropped_eval} "
                              f"overlong); set data.eval_path, data.eval_fraction > 0 or eval.every=0")
    sft = _sft_examples(d, tokenizer, train, sft_examples)
    return TaskData(train, evals, sft, {"train": dropped_train, "eval": dropped_eval})


def _sft_examples(d: DataOptions, tokenizer, train: list[Example], count: int) -> list[Example]:
    if count == 0:
        return []
    if d.kind == "arith_chain":  # fresh chains of their own seed, as many as SFT consumes
        task = ChainTaskConfig(**dict(d.task or {}))
        marked = float(d.sft_answer_marked)
        if not 0.0 <= marked <= 1.0:
            raise ValueError(f"data.sft_answer_marked: expected a fraction in [0, 1], got {marked}")
        style = random.Random(d.sft_seed * 7919 + 1)  # which demonstrations state the answer
        return [Example(render_prompt(r["prompt"], tokenizer, d.chat_template), r, r["answer"],
                        r["solution"] if style.random() < marked else without_answer(r["solution"]), "sft", i)
                for i, r in enumerate(make_dataset(count, d.sft_seed, task))]
    if not d.sft_key:
        raise ValueError("sft.steps > 0 needs data.sft_key (the row's reference response); or set sft.steps=0")
    return train


class PromptOrder:
    """Which train examples a step takes: epochs over the split, each epoch in a seeded order
    (``shuffle``) or the file's order. ``cursor`` counts prompts handed out so far (the data cursor a
    checkpoint stores)."""

    def __init__(self, size: int, shuffle: bool, seed: int, cursor: int = 0) -> None:
        self.size, self.shuffle, self.seed, self.cursor = size, shuffle, seed, cursor
        self._epoch, self._perm = -1, list(range(size))

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._perm = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._epoch = epoch
        return self._perm

    def take(self, k: int) -> list[int]:
        out = []
        for pos in range(self.cursor, self.cursor + k):
            out.append(self._order(pos // self.size)[pos % self.size])
        self.cursor += k
        return out
