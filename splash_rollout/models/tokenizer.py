"""Tokenizers, offline: a checkpoint's own ``tokenizer.json`` or the shipped glm5-nano one.

``load_tokenizer("glm5-nano")`` returns the 512-id byte-level BPE in
``splash_rollout/assets/glm5-nano/tokenizer.json`` (regenerate with
``scripts/build_nano_tokenizer.py``); any other argument is a checkpoint folder (or a
``tokenizer.json`` path). Special ids come from the folder's ``config.json`` / ``tokenizer_config.json``
when present, else from the usual token strings.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenizers import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
NANO_TOKENIZER = os.path.join(ASSETS, "glm5-nano", "tokenizer.json")


@dataclass
class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the special ids the engine needs."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Any of these ends a response."""
    pad_token_id: int | None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids (no special tokens unless ``add_bos`` and the tokenizer has a bos)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] + ids) if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


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
        return TextTokenizer(tok, bos_token_id=0, eos_token_ids=(1,), pad_token_id=2)
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
                         eos_token_ids=eos_ids, pad_token_id=pad if not isinstance(pad, list) else pad[0])
