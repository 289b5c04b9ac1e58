"""Tokenizers, offline: a checkpoint's own ``tokenizer.json`` or the shipped glm5-nano one.

``load_tokenizer("glm5-nano")`` returns the 512-id byte-level BPE in
``splash_rollout/assets/glm5-nano/tokenizer.json`` (regenerate with
``scripts/build_nano_tokenizer.py``); any other argument is a checkpoint folder (or a
``tokenizer.json`` path). Special ids come from the folder's ``config.json`` / ``tokenizer_config.json``
when present, else from the usual token strings.

Chat prompts: ``apply_chat_template(messages)`` turns ``[{"role": ..., "content": ...}, ...]`` into
prompt ids ending where the assistant's reply begins. A checkpoint folder whose
``tokenizer_config.json`` (or ``chat_template.jinja``) carries a template renders it with
transformers' tokenizer (the ``hf`` extra); the glm5-nano preset ships its own small template,
``NANO_CHAT_TEMPLATE``. Either way the ids are what the engine is given and what the trainer scores:
the text is never re-tokenised in between.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tokenizers import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
NANO_TOKENIZER = os.path.join(ASSETS, "glm5-nano", "tokenizer.json")
NANO_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""The glm5-nano chat template: one block per message, then ``<|assistant|>\n`` when a reply follows.
Plain text in the byte-level vocabulary (no extra special ids), so the nano model learns it in SFT."""
NANO_ROLES = ("system", "user", "assistant", "tool")

ChatRenderer = Callable[[Sequence[dict[str, Any]], bool], list[int]]
"""(messages, add_generation_prompt) -> prompt ids."""


class ChatTemplateError(ValueError):
    """A chat prompt cannot be rendered: malformed messages, or no template for this tokenizer."""


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` must be a non-empty list of ``{"role": str, "content": str}``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"chat messages: expected a non-empty list of {{role, content}} dicts, "
                                f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"chat messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.120}")
    return [dict(m) for m in messages]


@dataclass
class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the special ids the engine needs."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Any of these ends a response."""
    pad_token_id: int | None
    chat_renderer: ChatRenderer | None = field(default=None, repr=False, compare=False)
    """Renders chat messages to ids; None: this tokenizer has no chat template."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids (no special tokens unless ``add_bos`` and the tokenizer has a bos)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] + ids) if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_renderer is not None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """[num_prompt_tokens] ids of ``messages`` rendered by this tokenizer's chat template."""
        if self.chat_renderer is None:
            raise ChatTemplateError("chat messages given, but this tokenizer has no chat template (its "
                                    "tokenizer_config.json has no 'chat_template'); pass plain-text prompts")
        return [int(i) for i in self.chat_renderer(check_messages(messages), add_generation_prompt)]


def nano_chat_renderer(tok: Tokenizer) -> ChatRenderer:
    """The glm5-nano template (``NANO_CHAT_TEMPLATE``) over ``tok``; roles from ``NANO_ROLES``."""
    def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        for i, m in enumerate(messages):
            if m["role"] not in NANO_ROLES:
                raise ChatTemplateError(f"chat messages[{i}].role: expected one of {NANO_ROLES}, got {m['role']!r}")
        text = "".join(NANO_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return tok.encode(text, add_special_tokens=False).ids
    return render


def hf_chat_renderer(folder: str) -> ChatRenderer | None:
    """The checkpoint's own chat template through transformers' tokenizer, or None when the folder
    has none. Raises when it has one but transformers is not installed (the ``hf`` extra)."""
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    if not tok_config.get("chat_template") and not os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        def missing(messages, add_generation_prompt):
            raise ChatTemplateError(f"{folder}: its chat template needs transformers "
                                    f"(pip install 'splash_rollout[hf]')")
        return missing
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        out = hf.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)
    return render


def _read_json(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _token_id(tok: Tokenizer, value) -> int | None:
    """An id from a config value: an int, a token string, or a {"content": ...} dict."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def load_tokenizer(model_name_or_path: str | os.PathLike) -> TextTokenizer:
    key = os.fspath(model_name_or_path)
    if key == "glm5-nano":
        tok = Tokenizer.from_file(NANO_TOKENIZER)
        return TextTokenizer(tok, bos_token_id=0, eos_token_ids=(1,), pad_token_id=2,
                             chat_renderer=nano_chat_renderer(tok))
    if os.path.isfile(key):
        file, folder = key, os.path.dirname(key)
    else:
        file, folder = os.path.join(key, "tokenizer.json"), key
    if not os.path.isfile(file):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json at {key!r} (pass 'glm5-nano' or a checkpoint folder)")
    tok = Tokenizer.from_file(file)
    config = _read_json(os.path.join(folder, "config.json"))
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))

    def pick(name: str, fallbacks: tuple[str, ...]):
        for source in (config.get(name), tok_config.get(name), tok_config.get(name.replace("_id", ""))):
            if isinstance(source, list):
                ids = [_token_id(tok, v) for v in source]
                if all(i is not None for i in ids):
                    return ids
            elif (i := _token_id(tok, source)) is not None:
                return i
        for text in fallbacks:
            if (i := tok.token_to_id(text)) is not None:
                return i
        return None

    eos = pick("eos_token_id", ("</s>", "<|endoftext|>", "<｜end▁of▁sentence｜>"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bos = pick("bos_token_id", ("<s>", "<｜begin▁of▁sentence｜>"))
    pad = pick("pad_token_id", ("<pad>", "<|pad|>"))
    return TextTokenizer(tok, bos_token_id=bos if not isinstance(bos, list) else bos[0],
                         eos_token_ids=eos_ids, pad_token_id=pad if not isinstance(pad, list) else pad[0],
                         chat_renderer=hf_chat_renderer(folder))
