"""The shipped glm5-nano tokenizer and loading a checkpoint's own tokenizer.json."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from splash_rollout.models.config import PRESETS
from splash_rollout.models.tokenizer import NANO_TOKENIZER, load_tokenizer

TEXT = "Question: what is 123 + 45 * 6?\nStep 1: compute 45 * 6 = 270.\nAnswer: 393"


def test_nano_tokenizer_ids_and_round_trip():
    tok = load_tokenizer("glm5-nano")
    assert tok.vocab_size == PRESETS["glm5-nano"].vocab_size == 512
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1,), 2)
    assert [tok.tokenizer.id_to_token(i) for i in range(3)] == ["<s>", "</s>", "<pad>"]
    ids = tok.encode(TEXT)
    assert all(3 <= i < 512 for i in ids)
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_bos=True) == [0] + ids
    assert tok.decode([0] + ids + [1]) == TEXT  # specials skipped
    assert len(ids) < len(TEXT) * 0.7  # merges learned words, not just bytes
    assert tok.decode(tok.encode("é ✓ 日本")) == "é ✓ 日本"  # byte level: anything round-trips
    digits = tok.encode("9876")
    assert len(digits) == 4  # one token per digit


def test_build_script_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "build_nano_tokenizer", os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "build_nano_tokenizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "tokenizer.json"
    module.build().save(str(out), pretty=True)
    assert out.read_bytes() == open(NANO_TOKENIZER, "rb").read()


def test_checkpoint_folder_tokenizer(tmp_path):
    shutil.copy(NANO_TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1, 2), 2)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_token_ids == (1, 2)


def test_missing_tokenizer_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


HF_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_checkpoint_folder_chat_template_renders_through_transformers(tmp_path):
    shutil.copy(NANO_TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>", "chat_template": HF_TEMPLATE}))
    tok = load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "3+1=?"}]
    assert tok.has_chat_template
    assert tok.apply_chat_template(msgs) == tok.encode("[user] 3+1=?\n[assistant] ")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == tok.encode("[user] 3+1=?\n")


def test_no_chat_template_is_a_clear_error(tmp_path):
    from splash_rollout.models.tokenizer import ChatTemplateError

    shutil.copy(NANO_TOKENIZER, tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert load_tokenizer("glm5-nano").has_chat_template
