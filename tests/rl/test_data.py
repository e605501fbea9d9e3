"""Prompt data: JSONL and `datasets` folders, text and chat prompts; the reward function gets the
prompts and every column, as in TRL; bad data stops with the line or the column named."""

import json

import pytest
import rewards_for_tests
import torch
from helpers import no_run_written, run_cfg, tiny

from backstream import trainer
from backstream.rl.data import prompts as data

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")

ROWS = [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+{b}="}],
         "answer": str(a + b), "level": a % 3} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def chat_tiny():
    model, tok = tiny(torch.float32)
    tok.chat_template = CHAT_TEMPLATE
    return model, tok


def _train_on(tmp_path, path, model, tok):
    rewards_for_tests.SEEN.clear()
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', f'data.path="{path}"', "train.steps=1",
                  "reward.functions=['rewards_for_tests:record_columns']")
    return trainer.train(cfg, model=model, tokenizer=tok)


def test_chat_prompts_and_columns_reach_the_reward(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    model, tok = chat_tiny()
    _train_on(tmp_path, path, model, tok)
    (call,) = rewards_for_tests.SEEN
    # 2 prompts × 4 samples in TRL's conversational format: the prompt's messages, the completion as an
    # assistant message, its token ids, the step, the columns alongside
    assert len(call["prompts"]) == 8
    assert set(call) == {"prompts", "completions", "completion_ids", "completions_ids", "trainer_state", "log_metric",
                         "log_extra", "answer", "level"}
    assert call["trainer_state"].global_step == 0 and call["trainer_state"].max_steps == 1
    assert call["completion_ids"] == call["completions_ids"]  # TRL's name, and this project's older one
    for p, c, ids, a, lv in zip(call["prompts"], call["completions"], call["completion_ids"], call["answer"],
                                call["level"]):
        row = next(r for r in ROWS if r["answer"] == a)
        assert p == row["prompt"] and lv == row["level"]
        assert len(c) == 1 and c[0]["role"] == "assistant"
        assert c[0]["content"] == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("as_dict", [False, True])
def test_datasets_folder(tmp_path, as_dict):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)])
    if as_dict:  # a DatasetDict: the "train" split is read
        ds = datasets.DatasetDict({"test": ds.select([0]), "train": ds})
    folder = tmp_path / "ds"
    ds.save_to_disk(str(folder))
    assert len(data.load_examples(str(folder))) == 6
    model, tok = tiny(torch.float32)
    _train_on(tmp_path, folder, model, tok)
    (call,) = rewards_for_tests.SEEN  # text prompts: TRL's standard format, strings
    assert set(call) == {"prompts", "completions", "completion_ids", "completions_ids", "trainer_state", "log_metric",
                         "log_extra", "answer"}
    assert all(p.endswith("=") for p in call["prompts"]) and all(isinstance(c, str) for c in call["completions"])


@pytest.mark.parametrize("text, tokenizer_has_template, match", [
    ("".join(json.dumps(r) + "\n" for r in ROWS), False, "no chat_template"),
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n', True, "line 2 is not valid JSON"),
    ('{"prompt": 7, "answer": "2"}\n', True, "a prompt must be text or a list of chat messages"),
])
def test_bad_data_is_named_and_nothing_is_written(tmp_path, text, tokenizer_has_template, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    model, tok = chat_tiny() if tokenizer_has_template else tiny(torch.float32)
    with pytest.raises(ValueError, match=match):
        _train_on(tmp_path, path, model, tok)
    assert no_run_written(tmp_path / "run")
