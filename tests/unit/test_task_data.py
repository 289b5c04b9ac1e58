"""A user's own data: reading JSONL / Parquet / datasets folders, dotted keys, checks that name the
row and key, the held-out split, overlong filtering, the seeded order and chat-templated prompts."""
from __future__ import annotations

import json

import datasets
import pytest

from splash_rollout.recipes.grpo.rows import DataRowError, EmptySplitError, get_path, read_rows, split_rows
from splash_rollout.recipes.grpo.build import data_options
from splash_rollout.recipes.grpo.task_data import DataOptions, PromptOrder, build_task_data, render_prompt
from splash_rollout.models.tokenizer import ChatTemplateError, NANO_CHAT_TEMPLATE, load_tokenizer

TOK = load_tokenizer("glm5-nano")
ROWS = [{"messages": [{"role": "user", "content": f"{i}+1=?"}], "meta": {"answer": i + 1}, "solution": f"#{i + 1}"}
        for i in range(20)]


def data_cfg(path, **kw):
    base = dict(kind="file", path=str(path), eval_path=None, eval_fraction=0.25, prompt_key="messages",
                label_key="meta.answer", sft_key="solution", chat_template="auto", shuffle=True, seed=0,
                max_prompt_len=None)
    return DataOptions(**{**base, **kw})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dotted_paths():
    row = {"a": {"b": [10, {"c": "x"}]}}
    assert get_path(row, "a.b.0") == 10 and get_path(row, "a.b.1.c") == "x" and get_path(row, "a.b.-1.c") == "x"
    with pytest.raises(KeyError):
        get_path(row, "a.z")
    assert get_path(row, "a.b.7", None) is None


def test_jsonl_parquet_and_datasets_folder_read_the_same_rows(tmp_path):
    flat = [{"prompt": f"p{i}", "answer": i} for i in range(5)]
    write_jsonl(tmp_path / "d.jsonl", flat)
    datasets.Dataset.from_list(flat).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "saved"))
    assert read_rows(str(tmp_path / "d.jsonl")) == flat
    assert read_rows(str(tmp_path / "d.parquet")) == flat
    assert read_rows(str(tmp_path / "saved")) == flat
    with pytest.raises(ValueError, match=r"expected a \.jsonl"):
        read_rows(str(write_jsonl(tmp_path / "d.csv", flat)))
    (tmp_path / "bad.jsonl").write_text('{"prompt": 1}\n[1, 2]\n')
    with pytest.raises(DataRowError, match=r"bad.jsonl:2: expected a JSON object"):
        read_rows(str(tmp_path / "bad.jsonl"))


def test_missing_key_names_the_row_and_the_key(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[7] = {"messages": rows[7]["messages"], "meta": {}, "solution": "#8"}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataRowError, match=r"row 7 has no 'meta.answer' \(data.label_key\)"):
        build_task_data(data_cfg(path, eval_fraction=0.0), TOK, None, need_eval=False)


def test_held_out_split_overlong_filter_and_empty_eval(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS + [{**ROWS[0], "messages": [{"role": "user", "content": "9" * 300}]}])
    data = build_task_data(data_cfg(path), TOK, max_prompt_len=40, need_eval=True, sft_examples=4)
    assert len(data.train) + len(data.eval) + sum(data.filtered.values()) == 21
    assert sum(data.filtered.values()) == 1 and len(data.eval) == 5  # round(0.25 * 21)
    assert data.metrics()["data/overlong_filtered/train"] + data.metrics()["data/overlong_filtered/eval"] == 1
    train_labels = {ex.label for ex in data.train}
    assert not train_labels & {ex.label for ex in data.eval}  # disjoint: every row has its own label
    assert data.sft == data.train and data.train[0].target == f"#{data.train[0].label}"
    with pytest.raises(EmptySplitError, match=r"the eval split is empty"):
        build_task_data(data_cfg(path, eval_fraction=0.0), TOK, None, need_eval=True)
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(EmptySplitError, match=r"data.eval_path=.*e.jsonl: the eval split is empty"):
        build_task_data(data_cfg(path, eval_path=str(empty)), TOK, None, need_eval=True)


def test_split_is_seeded_and_keeps_one_row():
    rows = [{"i": i} for i in range(10)]
    assert split_rows(rows, 0.3, 1) == split_rows(rows, 0.3, 1) != split_rows(rows, 0.3, 2)
    assert len(split_rows(rows, 0.01, 0)[1]) == 1 and split_rows(rows, 0.0, 0) == (rows, [])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_rows(rows, 1.0, 0)


def test_prompt_order_epochs_and_cursor():
    order = PromptOrder(5, shuffle=True, seed=3)
    first = order.take(5) + order.take(5)
    assert sorted(first[:5]) == sorted(first[5:]) == list(range(5)) and first[:5] != first[5:]
    resumed = PromptOrder(5, shuffle=True, seed=3, cursor=3)
    assert resumed.take(4) == first[3:7] and resumed.cursor == 7
    assert PromptOrder(3, shuffle=False, seed=0).take(5) == [0, 1, 2, 0, 1]


def test_chat_prompts_render_through_the_nano_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2=?"}]
    ids = render_prompt(msgs, TOK, "auto")
    text = "".join(NANO_CHAT_TEMPLATE.format(**m) for m in msgs) + "<|assistant|>\n"
    assert ids == TOK.encode(text) and TOK.decode(ids) == text
    assert render_prompt("2+2=?", TOK, "auto") == TOK.encode("2+2=?")
    assert render_prompt("2+2=?", TOK, "always") == TOK.apply_chat_template([{"role": "user", "content": "2+2=?"}])
    with pytest.raises(DataRowError, match="chat_template=never"):
        render_prompt(msgs, TOK, "never")
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.role"):
        TOK.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]"):
        TOK.apply_chat_template([{"role": "user", "content": "x"}, {"role": "user"}])


def test_malformed_messages_in_a_file_name_the_row(tmp_path):
    rows = [dict(r) for r in ROWS[:3]]
    rows[2] = {**rows[2], "messages": [{"role": "user", "text": "no content"}]}
    with pytest.raises(DataRowError, match=r"row 2, 'messages' \(data.prompt_key\).*messages\[0\]"):
        build_task_data(data_cfg(write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0), TOK, None, False)


def test_reasoning_gym_task_as_chat_prompts():
    from splash_rollout.run import compose_config

    cfg = compose_config(["+recipe=grpo_glm5", "data=reasoning_gym", "data.size=6", "data.eval_size=3", "reward=reasoning_gym"])
    data = build_task_data(data_options(cfg), TOK, None, need_eval=True, sft_examples=4)
    assert (len(data.train), len(data.eval)) == (6, 3) and data.sft == data.train
    first = data.train[0]
    assert TOK.decode(first.prompt_ids) == f"<|user|>\n{first.row['question']}\n<|assistant|>\n"
    assert first.label == first.row["answer"] == first.target
    assert first.row["metadata"]["source_dataset"] == "basic_arithmetic"


def test_sft_answer_marked_is_the_share_of_demonstrations_stating_the_answer():
    from splash_rollout.run import compose_config

    def targets(marked):
        cfg = compose_config(["+recipe=grpo_glm5", f"data.sft_answer_marked={marked}", "data.eval_size=0"])
        return [ex.target for ex in build_task_data(data_options(cfg), TOK, None, need_eval=False, sft_examples=400,
                                                    fresh_prompts=4).sft]

    full, quarter, none = targets(1.0), targets(0.25), targets(0.0)
    assert all("#" in t for t in full) and not any("#" in t for t in none)
    assert [t.split("#")[0] for t in full] == none  # the same chains, stopped at their last step
    assert 0.18 < sum("#" in t for t in quarter) / 400 < 0.32
    with pytest.raises(ValueError, match="data.sft_answer_marked"):
        targets(1.5)
