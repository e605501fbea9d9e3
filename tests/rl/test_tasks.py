"""The built-in tasks: deterministic data, the documented columns and formats, the exact-match rule."""

import re

import pytest

from backstream.rl.data.tasks import KV_PAIRS, TASKS, Task, get_task, make_dataset, score, toolcalc_episode


@pytest.mark.parametrize("name", sorted(TASKS))
def test_dataset_is_deterministic_and_has_the_columns(name):
    a = make_dataset(name, 20, seed=3)
    assert a == make_dataset(name, 20, seed=3)
    assert a != make_dataset(name, 20, seed=4)
    assert make_dataset(name, 5, seed=3) == a[:5]  # a longer dataset extends a shorter one
    for row in a:
        if TASKS[name].images:  # chat messages with an image part, the picture in `images`
            assert [p["type"] for p in row["prompt"][0]["content"]] == ["image", "text"]
            assert len(row["images"]) == 1
        else:
            assert isinstance(row["prompt"], str) and row["prompt"]
        assert isinstance(row["answer"], str) and row["answer"].isdigit()
        assert row["task"] == name


def test_registry():
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name
        # the answer of the row's last turn, or (shapes_turns) the environment's share of its turns answered right
        assert task.reward == ("env" if name == "shapes_turns" else "exact_match")
        assert task.max_new_tokens >= 4  # 3 answer digits + <eos>
    assert get_task(TASKS["arith"]) is TASKS["arith"]
    with pytest.raises(ValueError, match="unknown task"):
        make_dataset("nope", 1)
    with pytest.raises(ValueError, match="n=-1"):
        make_dataset("arith", -1)
    assert make_dataset("arith", 0) == []


def test_arith_rows_are_right():
    for row in make_dataset("arith", 200, seed=0):
        m = re.fullmatch(r"(\d\d)\+(\d\d)=", row["prompt"])
        assert m, row["prompt"]
        assert int(row["answer"]) == int(m[1]) + int(m[2])


def test_kvlookup_rows_are_right_and_long():
    from transformers import AutoTokenizer

    from backstream.default_model import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    for row in make_dataset("kvlookup", 10, seed=1):
        prompt = row["prompt"]
        pairs = re.findall(r"^([a-z]{4})=(\d{3})$", prompt, flags=re.M)
        assert len(pairs) == KV_PAIRS
        assert len({k for k, _ in pairs}) == KV_PAIRS  # keys distinct: the answer is unique
        key = re.search(r"What is ([a-z]{4})\?\n\1=$", prompt)[1]
        assert dict(pairs)[key] == row["answer"]
        assert len(tok(prompt)["input_ids"]) >= 1024


def test_toolcalc_rows_are_right():
    for row in make_dataset("toolcalc", 200, seed=0):
        m = re.fullmatch(r"(\d\d)\+(\d\d)\+(\d\d)=", row["prompt"])
        assert m, row["prompt"]
        assert int(row["answer"]) == int(m[1]) + int(m[2]) + int(m[3])


def test_toolcalc_episode_is_one_the_sampler_plays():
    """The episode scripts/make_default_model.py teaches is what the episode sampler would make of the
    same turns: each call turn parses as a well-formed `add` call in the plain format, the Calculator's
    result rendered by the format is the inserted part, token for token, and the last turn is an
    answer the exact-match reward scores 1."""
    from backstream.default_model import build_tokenizer
    from backstream.rl.agent.env import EnvConfig, Environment
    from backstream.rl.agent.turns import PlainFormat

    tok = build_tokenizer()
    env = Environment.load(EnvConfig(factory=TASKS["toolcalc"].defaults["env.factory"]))
    fmt = PlainFormat(tok, env.schemas)
    for row in make_dataset("toolcalc", 20, seed=1):
        a, b, c = map(int, row["prompt"].rstrip("=").split("+"))
        assert toolcalc_episode(row, use_tool=False) == [(f"{a + b + c}<eos>", True)]
        parts = toolcalc_episode(row)
        assert [sampled for _, sampled in parts] == [True, False, True, False, True]
        instance = env.new(row, 0)[0]
        args = []
        for (turn, _), (inserted, _) in zip(parts[0:4:2], parts[1:4:2]):
            ids = fmt.encode(turn)
            assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
            _, calls = fmt.parse(ids)
            assert len(calls) == 1 and calls[0].name == "add" and calls[0].error is None
            args.append(calls[0].arguments)
            content, failed = env.call(instance, calls[0])[:2]
            assert not failed and fmt.tool_results([("add", content)]) == fmt.encode(inserted)
        assert args == [{"a": a, "b": b}, {"a": a + b, "b": c}]
        message, calls = fmt.parse(fmt.encode(parts[-1][0]))
        assert calls == [] and score(message["content"], row["answer"]) == 1.0
        instance.release()


def test_toolcalc_defaults_apply_where_the_run_leaves_them_unset():
    from backstream import config

    cfg = config.load(None, ["data.task=toolcalc"])
    for key, value in TASKS["toolcalc"].defaults.items():
        section, name = key.split(".", 1)
        assert getattr(getattr(cfg, section), name) == value, key
    assert cfg.env.factory == "backstream.rl.data.tasks:Calculator" and cfg.env.enabled
    assert config.load(None, ["data.task=toolcalc", "env.max_turns=6"]).env.max_turns == 6  # the run's own wins
    assert not config.load(None, ["data.task=arith"]).env.enabled  # other tasks: no environment


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("82", "82", 1.0),
        (" 82\n", "82", 1.0),  # stripped
        ("082", "82", 1.0),  # numbers compare numerically
        ("82.0", "82", 1.0),
        ("1,000", "1000", 1.0),
        ("81", "82", 0.0),
        ("8", "82", 0.0),
        ("", "82", 0.0),
        ("82 83", "82", 0.0),  # the whole completion is the answer, not a substring of it
        ("I think 37+45 is 82", "82", 0.0),
        ("37+45 = 82 #### 82", "82", 1.0),  # after the last ####
        ("#### 81 #### 82", "82", 1.0),
        ("#### 82 #### 81", "82", 0.0),
        ("abc", "abc", 1.0),  # non-numbers compare as strings
        ("abc", "abd", 0.0),
    ],
)
def test_score(completion, answer, expected):
    assert score(completion, answer) == expected


def test_score_agrees_with_the_exact_match_reward():
    from backstream.rl.scoring.builtin import exact_match, load_reward

    cases = [("82", "82"), (" 082 ", "82"), ("81", "82"), ("x #### 7", "7"), ("", "1"), ("ab", "ab")]
    for name in TASKS:
        cases += [(r["answer"], r["answer"]) for r in make_dataset(name, 3)]
    completions, answers = zip(*cases)
    assert exact_match(list(completions), answer=list(answers)) == [score(c, a) for c, a in cases]
    assert load_reward(TASKS["arith"].reward)  # the spec string is one the trainer accepts


# -- built-in tasks on chat models (issue 42) --------------------------------------------------------


class _Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("name", sorted(n for n in TASKS if not TASKS[n].images))
def test_a_task_for_a_chat_model_asks_in_words_and_for_the_answers_form(name):
    from backstream.rl.data.prompts import DataConfig

    plain = make_dataset(name, 5, seed=1)
    rows = DataConfig(task=name, num_examples=5, format="chat").build(1)
    for p, r in zip(plain, rows):
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith("Answer with the number only.")
        assert r["answer"] == p["answer"] and "=" not in msg["content"].splitlines()[-1]
    assert DataConfig(task=name, num_examples=5, format="plain").build(1) == plain


def test_a_visual_task_is_chat_messages_in_both_formats():
    from backstream.rl.data.prompts import DataConfig

    plain = make_dataset("shapes", 3, seed=1)
    for fmt in ("chat", "plain"):
        rows = DataConfig(task="shapes", num_examples=3, format=fmt).build(1)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]
        assert [r["answer"] for r in rows] == [r["answer"] for r in plain]


def test_format_auto_follows_the_tokenizer_and_picks_the_reward():
    from backstream import config
    from backstream.rl.data.prompts import DataConfig

    assert DataConfig().resolved_format(_Tok(None)) == "plain"
    assert DataConfig().resolved_format(_Tok("{{ x }}")) == "chat"
    with pytest.raises(ValueError, match=r'^data.format = "chat": the tokenizer has no chat template'):
        DataConfig(format="chat").resolved_format(_Tok(None))
    cfg = config.load(None, []).for_tokenizer(_Tok("{{ x }}"))
    assert cfg.data.format == "chat" and cfg.reward.functions == ["answer"]
    own = config.load(None, ["reward.functions=['format:.*']"]).for_tokenizer(_Tok("{{ x }}"))
    assert own.reward.functions == ["format:.*"]  # a reward of the user's own is kept
    plain = config.load(None, []).for_tokenizer(_Tok(None))
    assert plain.data.format == "plain" and plain.reward.functions == ["exact_match"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_plain_format_stops_at_the_end_of_the_answer(name):
    """A plain answer is one line: arith and kvlookup stop a completion at a newline (a base model goes on
    after the answer); toolcalc's turns end with the end-of-sequence token; the chat format ends with the
    template's end of turn; a stop of the run's own is kept."""
    from backstream import config

    plain = config.load(None, [f'data.task="{name}"']).for_tokenizer(_Tok(None))
    assert plain.rollout.stop == (["\n"] if name in ("arith", "kvlookup") else [])
    chat = config.load(None, [f'data.task="{name}"']).for_tokenizer(_Tok("{{ x }}"))
    assert chat.rollout.stop == []
    own = config.load(None, [f'data.task="{name}"', "rollout.stop=['.']"]).for_tokenizer(_Tok(None))
    assert own.rollout.stop == ["."]
    data = config.load(None, ['data.path="x.jsonl"']).for_tokenizer(_Tok(None))
    assert data.rollout.stop == []  # a user's own data: rollout.stop as set


def test_the_reward_reads_the_answer_before_the_stop():
    """A base model's completion "82\n" (or a token "\n\n" holding more than the stop) is scored on "82";
    one that ended otherwise is read whole; the trained tokens keep the stop."""
    import torch

    from backstream.rl.records import Samples
    from backstream.rl.rollout.completions import before_stop, completion_reward_inputs

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    texts, reasons = ["82\n", "82\n\n", "8 2", "82\n38"], ["stop", "stop", "length", "eos"]
    r = Samples(prompt_index=[0] * 4, prompt_ids=[torch.tensor([61])] * 4,
                completion_ids=[torch.tensor([ord(c) for c in t]) for t in texts],
                logprobs=[torch.zeros(len(t)) for t in texts], finish_reason=reasons, group_size=4)
    completions, _, extra = completion_reward_inputs(r, [{"prompt": "37+45="}] * 4, Chars(), ["37+45="], ["\n"])
    assert completions == ["82", "82", "8 2", "82\n38"]
    assert extra["completion_ids"][0] == [56, 50, 10]  # the stop stays in what is trained
    assert before_stop("a;b.c", [".", ";"]) == "a" and before_stop("abc", ["."]) == "abc"


def test_kvlookup_in_words_keeps_every_pair():
    row = make_dataset("kvlookup", 1, seed=2)[0]
    text = TASKS["kvlookup"].chat(row)
    key = row["prompt"].rsplit("\n", 1)[1].rstrip("=")
    assert text.count("=") == KV_PAIRS and f"What is the value of {key}? Answer" in text


# -- solved examples before the prompt: data.shots (issue 56) ----------------------------------------

def test_shots_are_solved_rows_of_the_task_none_the_row_itself():
    """data.shots = 3: every prompt is three solved rows of its task ("a+b=c\n", c right) and then the row's
    own, which none of them repeats; the same for the same seed, drawn per row (rows differ in shots)."""
    from backstream.rl.data.prompts import DataConfig

    plain = make_dataset("arith", 64, seed=2)
    rows = DataConfig(task="arith", num_examples=64, shots=3, format="plain").build(2)
    assert rows == DataConfig(task="arith", num_examples=64, shots=3, format="plain").build(2)
    for p, r in zip(plain, rows):
        *shots, question = r["prompt"].split("\n")
        assert question == p["prompt"] and r["answer"] == p["answer"] and len(shots) == 3
        for line in shots:
            a, b, c = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", line).groups())
            assert a + b == c and f"{a}+{b}=" != p["prompt"]
        assert len(set(shots)) == 3
    assert len({r["prompt"].rsplit("\n", 1)[0] for r in rows}) == 64  # each row its own examples
    (kv,) = DataConfig(task="kvlookup", num_examples=1, shots=1, format="plain").build(0)
    (row,) = make_dataset("kvlookup", 1, 0)
    shot = kv["prompt"].removesuffix(row["prompt"])  # the solved example comes whole, then the row
    assert shot != kv["prompt"] and shot.startswith("Remember these pairs.\n") and shot.endswith("\n")
    key, value = re.search(r"\n(\w+)=(\d+)\n$", shot).groups()
    assert f"\n{key}={value}\n" in shot.split("What is")[0]  # the answer is the pair's value


def test_shots_in_the_chat_format_are_turns_before_the_question():
    from backstream.rl.data.prompts import DataConfig

    (row,) = DataConfig(task="arith", num_examples=1, shots=2, format="chat").build(0)
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    for ask, answer in zip(row["prompt"][0:4:2], row["prompt"][1:4:2]):
        a, b = map(int, re.search(r"What is (\d+)\+(\d+)\?", ask["content"]).groups())
        assert answer["content"] == str(a + b)
    assert row["prompt"][-1]["content"] == TASKS["arith"].chat(make_dataset("arith", 1, 0)[0])


def test_shots_are_refused_where_there_is_nothing_to_show():
    from backstream.rl.data.prompts import DataConfig

    with pytest.raises(ValueError, match=r"data.shots = 2: task toolcalc's solved example would be a whole episode"):
        DataConfig(task="toolcalc", shots=2)
    with pytest.raises(ValueError, match=r"data.shots = 1: solved examples are drawn from a built-in task"):
        DataConfig(path="x.jsonl", shots=1)
    with pytest.raises(ValueError, match="data.shots"):
        DataConfig(shots=-1)
    assert DataConfig(task="toolcalc", shots=0).shots == 0


def test_a_base_model_gets_three_shots_and_the_default_model_none(caplog):
    """data.format = "auto" with a model without a chat template that is not the shipped default: 3 shots,
    said at start-up; the default model keeps its zero-shot prompts, a chat model its template, and a run
    that sets data.shots (or data.format = "plain") keeps what it says."""
    import logging

    from backstream import config

    base = ['model.name="some/base-model"']
    with caplog.at_level(logging.INFO, logger="backstream"):
        cfg = config.load(None, base).for_tokenizer(_Tok(None))
    assert cfg.data.shots == 3 and cfg.data.format == "plain"
    assert "a base model without a chat template: 3 solved examples before each prompt (data.shots)" in caplog.text
    assert config.load(None, []).for_tokenizer(_Tok(None)).data.shots == 0  # the shipped default model
    assert config.load(None, base).for_tokenizer(_Tok("{{ x }}")).data.shots == 0  # a chat model
    assert config.load(None, [*base, "data.shots=1"]).for_tokenizer(_Tok(None)).data.shots == 1
    assert config.load(None, [*base, 'data.format="plain"']).for_tokenizer(_Tok(None)).data.shots == 0
    assert config.load(None, [*base, 'data.task="toolcalc"']).for_tokenizer(_Tok(None)).data.shots == 0


def test_the_default_models_prompts_are_the_tasks_rows_unchanged():
    """The demo's data: with no shots, the plain prompts are the generator's rows, byte for byte."""
    from backstream.rl.data.prompts import DataConfig

    for name in sorted(TASKS):
        assert DataConfig(task=name, num_examples=40, format="plain", shots=0).build(7) == make_dataset(name, 40, 7)


def test_the_evaluation_shows_the_trainings_shots_in_its_format():
    """Held-out rows of a built-in task get the training's shots (or eval.shots') and format: a chat
    model is evaluated on chat messages, as it trains; none is a training row."""
    from backstream.rl.data.prompts import DataConfig
    from backstream.rl.rollout.evaluate import EvalConfig, held_out

    train = {r["prompt"] for r in make_dataset("arith", 32, 0)}
    held = held_out(EvalConfig(prompts=20), DataConfig(task="arith", num_examples=32, shots=2, format="plain"), 0)
    assert all(len(r["prompt"].split("\n")) == 3 and r["prompt"].split("\n")[-1] not in train for r in held)
    zero = held_out(EvalConfig(prompts=20, shots=0), DataConfig(task="arith", num_examples=32, shots=2), 0)
    assert [r["prompt"] for r in zero] == [r["prompt"].split("\n")[-1] for r in held]
    chat = held_out(EvalConfig(prompts=5), DataConfig(task="arith", num_examples=32, format="chat"), 0)
    assert all(r["prompt"][-1]["role"] == "user" and "Answer with" in r["prompt"][-1]["content"] for r in chat)


def test_shapes_rows_are_right():
    """The answer is the number of shapes (4-connected regions) of the asked colour in the picture."""
    from backstream.rl.data.shapes import PALETTE, SIZE

    answers = set()
    for row in make_dataset("shapes", 60, seed=0):
        color = row["prompt"][0]["content"][1]["text"].rstrip("?")
        img = row["images"][0]
        assert img.size == (SIZE, SIZE) and img.mode == "RGB"
        px = img.load()
        todo = {(x, y) for x in range(SIZE) for y in range(SIZE) if px[x, y] == PALETTE[color]}
        regions = 0
        while todo:
            regions += 1
            stack = [todo.pop()]
            while stack:
                x, y = stack.pop()
                for q in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                    if q in todo:
                        todo.remove(q)
                        stack.append(q)
        assert str(regions) == row["answer"]
        answers.add(row["answer"])
    assert answers >= {"0", "1", "2", "3"}


def test_shots_on_a_visual_task_are_refused_by_name():
    from backstream.rl.data.prompts import check_shots

    with pytest.raises(ValueError, match="data.shots = 2: task shapes's solved example would be a conversation with "
                                         "pictures"):
        check_shots("shapes", 2, "data.shots")
