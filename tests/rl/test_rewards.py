"""Reward functions: built-ins on hand-written cases, spec loading, weighting, every error path,
and a tiny random reward model whose batched scores equal its one-at-a-time scores."""

import threading

import pytest
import torch

from backstream.rl.scoring import builtin
from backstream.rl.scoring import rewards as R
from backstream.rl.scoring.answers import final_answer
from backstream.rl.scoring.builtin import exact_match, format_reward, load_reward
from backstream.rl.scoring.reward_model import RewardModel
from backstream.rl.scoring.rewards import RewardConfig, RewardError, Rewards

# ------------------------------------------------------------------ built-ins


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("42", "42", 1.0),
        ("  42 \n", "42", 1.0),  # whitespace
        ("42.0", "42", 1.0),  # numeric, not textual
        ("1,000", "1000", 1.0),  # thousands separator
        ("-3", "-3.00", 1.0),
        ("41", "42", 0.0),
        ("so 6*7 is\n#### 42", "42", 1.0),  # GSM8K marker
        ("#### 1 then #### 42 ", "42", 1.0),  # the last marker wins
        ("Natalia sold 72 clips.\n#### 72", "In May ... #### 72", 1.0),  # gold marker too
        ("thus \\boxed{42}.", "42", 1.0),
        ("\\boxed{1} or \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # last box, nested braces
        ("\\boxed{ 7 }", "7", 1.0),
        ("the answer is 42", "42", 0.0),  # no marker: the whole text must match
        ("Paris", " Paris ", 1.0),  # non-numbers compare as stripped text
        ("paris", "Paris", 0.0),
        ("nan", "nan", 1.0),  # "nan" is text here, not a number that never equals itself
        ("inf", "1e400", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match([completion], answer=[answer], prompts=["p"]) == [expected]


def test_final_answer_unclosed_box_falls_back_to_the_whole_text():
    assert final_answer("  \\boxed{12  ") == "\\boxed{12"


def test_format_reward_full_match():
    f = format_reward(r"<think>.*</think>\s*<answer>.*</answer>")
    completions = [
        "<think>a\nb</think>\n<answer>4</answer>",  # DOTALL: '.' crosses the newline
        "<think>a</think><answer>4</answer> trailing",  # not a full match
        "<answer>4</answer>",
    ]
    assert f(completions, prompts=["p"] * 3) == [1.0, 0.0, 0.0]
    assert format_reward(r"a.b", flags=0)(["a\nb", "axb"]) == [0.0, 1.0]


def test_math_verify():
    pytest.importorskip("math_verify")
    cases = [
        ("so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("it is $0.5$", "$\\frac12$", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("#### 1,000", "1000", 1.0),
        ("\\boxed{x^2 + 1}", "x^2+1", 1.0),  # bare LaTeX gold
        ("\\boxed{x^2 - 1}", "x^2+1", 0.0),
        ("she has 72 clips", "blah blah #### 72", 1.0),  # GSM8K gold
        ("no idea", "7", 0.0),
        ("", "", 1.0),  # an unparseable gold falls back to exact_match
    ]
    completions, answers, expected = zip(*cases)
    assert builtin.math(list(completions), answer=list(answers)) == list(expected)


def test_math_verify_in_a_worker_thread():
    # Math-Verify's own timeout uses signal.alarm, which fails outside the main thread
    pytest.importorskip("math_verify")
    rewards = Rewards([("math", 1.0)], timeout_s=30)
    total, _ = rewards(["\\boxed{2}"], ["1+1?"], {"answer": ["2"]})
    assert total.tolist() == [1.0]


def test_math_without_math_verify(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'backstream\[math\]'"):
        builtin.math(["1"], answer=["1"])
    with pytest.raises(ImportError, match="backstream"):
        load_reward("math")


# ------------------------------------------------------------------ specs

USER_CODE = """
def length_penalty(completions, **kwargs):
    return [-0.1 * len(c) for c in completions]
NOT_A_FUNCTION = 3
"""


def test_load_builtin_specs():
    assert load_reward("exact_match") is exact_match
    f = load_reward("format:x+")
    assert f(["xxx", "xy"]) == [1.0, 0.0]
    assert load_reward("backstream.rl.scoring.builtin:exact_match") is exact_match


def test_load_from_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scores.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    f = load_reward("my_rewards_pkg.scores:length_penalty")
    assert f(["ab", "abcd"]) == pytest.approx([-0.2, -0.4])


def test_load_from_file_path(tmp_path):
    path = tmp_path / "sub" / "my_reward.py"
    path.parent.mkdir()
    path.write_text(USER_CODE)
    f = load_reward(f"{path}:length_penalty")
    assert f(["abc"]) == pytest.approx([-0.3])


def test_load_errors(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(USER_CODE)
    for spec in ["nope", "", "format:", "a.b:", "exact-match"]:
        with pytest.raises(ValueError, match="accepted forms") as e:
            load_reward(spec)
        assert "reward_model:<local folder>" in str(e.value)
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(TypeError, match="NOT_A_FUNCTION"):
        load_reward(f"{path}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="no file"):
        load_reward(f"{tmp_path / 'absent.py'}:f")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        load_reward("no_such_module_xyz:f")


# ------------------------------------------------------------------ config


def test_config_defaults_and_build():
    cfg = RewardConfig(functions=["exact_match", "format:.*####.*"], weights=[1, 0.5])
    assert cfg.weights == [1.0, 0.5] and isinstance(cfg.weights[0], float)
    rewards = cfg.build()
    assert list(rewards.weights.values()) == [1.0, 0.5]
    assert RewardConfig().functions == ["exact_match"]
    assert Rewards(RewardConfig(functions=["exact_match"])).weights == {"exact_match": 1.0}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(functions=[]), ["functions=[]", "non-empty"]),
        (dict(functions="exact_match"), ["functions='exact_match'", "list of specs"]),
        (dict(functions=["bogus"]), ["'bogus'", "accepted forms"]),
        (dict(functions=[3]), ["3", "string spec"]),
        (dict(functions=["exact_match"], weights=[1.0, 2.0]), ["weights=[1.0, 2.0]", "one weight"]),
        (dict(functions=["exact_match"], weights=[float("nan")]), ["weights=[nan]", "finite"]),
        (dict(functions=["exact_match"], weights=["1"]), ["weights=['1']", "finite number"]),
        (dict(functions=["exact_match"], weights=2.0), ["weights=2.0", "one weight per function"]),
        (dict(timeout_s=0), ["timeout_s=0", "positive", "None"]),
        (dict(timeout_s=-1.5), ["timeout_s=-1.5", "positive"]),
    ],
)
def test_config_validation(kwargs, words):
    with pytest.raises(ValueError) as e:
        RewardConfig(**kwargs)
    for word in words:
        assert word in str(e.value)


# ------------------------------------------------------------------ combination


def test_weighted_sum():
    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    def uses_columns(completions, prompts, difficulty, **kw):
        assert prompts == ["p0", "p1", "p2"]
        return [d * 1.0 for d in difficulty]

    rewards = Rewards(
        [(length, 0.5), ("exact_match", 2.0), (uses_columns, -1.0), ("format:\\d+", 1.0)]
    )
    completions = ["42", "#### 7", "abc"]
    total, per = rewards(
        completions, ["p0", "p1", "p2"], {"answer": ["42", "8", "abc"], "difficulty": [1, 2, 3]}
    )
    # by hand: 0.5·len + 2·match − difficulty + digits-only
    #   "42":     0.5·2 + 2·1 − 1 + 1 = 3.0
    #   "#### 7": 0.5·6 + 2·0 − 2 + 0 = 1.0
    #   "abc":    0.5·3 + 2·1 − 3 + 0 = 0.5
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert total.tolist() == [3.0, 1.0, 0.5]
    assert list(per) == ["length", "exact_match", "uses_columns", "format"]
    assert per["length"].tolist() == [2.0, 6.0, 3.0]  # unweighted
    assert per["exact_match"].tolist() == [1.0, 0.0, 1.0]


def test_duplicate_names_kept_apart():
    f = format_reward("a")
    rewards = Rewards([(f, 1.0), (f, 2.0)])
    total, per = rewards(["a", "b"], ["p", "q"], {})
    assert len(per) == 2 and total.tolist() == [3.0, 0.0]


def test_functions_get_fresh_lists():
    def mutates(completions, **kw):
        completions.clear()
        return []

    def reads(completions, **kw):
        return [1.0] * len(completions)

    total, _ = Rewards([(mutates, 1.0), (reads, 1.0)])([], [], {})
    assert total.shape == (0,)
    with pytest.raises(RewardError):  # mutates returns [] for 1 sample
        Rewards([(mutates, 1.0), (reads, 1.0)])(["x"], ["p"], {})


# ------------------------------------------------------------------ error paths

PROMPTS = ["What is 1+1?", "What is 2+2? " + "x" * 200, "What is 3+3?"]
COMPLETIONS = ["2", "4", "6"]


def _call(fn, timeout_s=None, columns=None):
    rewards = Rewards([(fn, 1.0)], timeout_s=timeout_s)
    columns = columns if columns is not None else {"answer": COMPLETIONS}
    return rewards(COMPLETIONS, PROMPTS, columns)


def test_error_raises_names_function_and_sample():
    def picky(completions, **kw):
        return [1.0 / (c != "4") for c in completions]  # ZeroDivisionError on sample 1

    with pytest.raises(RewardError) as e:
        _call(picky)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "'picky'" in msg and "ZeroDivisionError" in msg and "sample 1" in msg
    assert "What is 2+2? " + "x" * 67 in msg and "x" * 100 not in msg  # the prompt, cut at 80
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_error_raises_only_on_the_whole_batch():
    def needs_three(completions, **kw):
        if len(completions) != 3:
            return [0.0] * len(completions)
        raise RuntimeError("batch-level failure")

    with pytest.raises(RewardError, match="'needs_three' raised RuntimeError: batch-level") as e:
        _call(needs_three)
    assert "no single sample fails" in str(e.value)


@pytest.mark.parametrize(
    "returned, words",
    [
        ((1.0, 2.0), ["returned 2 values for 3 samples", "sample 2"]),
        ([1.0] * 4, ["returned 4 values for 3 samples", "sample 3"]),
        (torch.ones(3, 1), ["returned a Tensor", "list of 3 floats"]),  # a 1-D tensor is accepted
        (None, ["returned a NoneType"]),
        ([1.0, "1", 0.0], ["'1' (str)", "sample 1", "What is 2+2?"]),
        ([1.0, 0.0, None], ["None (NoneType)", "sample 2", "What is 3+3?"]),
        ([float("nan"), 0.0, 0.0], ["returned nan", "sample 0", "What is 1+1?"]),
        ([0.0, float("-inf"), 0.0], ["returned -inf", "sample 1"]),
    ],
)
def test_error_bad_return(returned, words):
    def bad(completions, **kw):
        return returned

    with pytest.raises(RewardError) as e:
        _call(bad)
    assert "'bad'" in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_accepts_ints_bools_and_tuples():
    total, _ = _call(lambda completions, **kw: (1, True, 0.5))
    assert total.tolist() == [1.0, 1.0, 0.5]


def test_error_missing_column():
    with pytest.raises(RewardError, match=r"'exact_match' needs column\(s\) \['answer'\].*'level'"):
        _call(exact_match, columns={"level": [1, 2, 3]})


def test_error_timeout():
    release = threading.Event()

    def slow(completions, **kw):
        release.wait(5)
        return [0.0] * len(completions)

    try:
        with pytest.raises(RewardError, match=r"'slow' did not return within timeout_s=0.05"):
            _call(slow, timeout_s=0.05)
    finally:
        release.set()
    # within the limit, the worker thread's result comes back; its exceptions too
    assert _call(lambda completions, **kw: [2.0] * 3, timeout_s=5)[0].tolist() == [2.0] * 3
    with pytest.raises(RewardError, match="raised KeyError"):
        _call(lambda completions, **kw: {}["k"], timeout_s=5)


def test_error_inconsistent_inputs():
    rewards = Rewards([(exact_match, 1.0)])
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        rewards(COMPLETIONS, PROMPTS[:2], {"answer": COMPLETIONS})
    with pytest.raises(ValueError, match="column 'answer' has 2 rows for 3 samples"):
        rewards(COMPLETIONS, PROMPTS, {"answer": COMPLETIONS[:2]})
    with pytest.raises(TypeError, match="not callable"):
        Rewards([(3, 1.0)])
    with pytest.raises(ValueError, match="at least one"):
        Rewards([])
    with pytest.raises(ValueError, match="timeout_s=0"):
        Rewards([(exact_match, 1.0)], timeout_s=0)


# ------------------------------------------------------------------ reward model


def _tiny_reward_model(family):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,?!:+-*/=#\n"
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # per char
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    tokenizer.padding_side = "left"  # RewardModel must not depend on the tokenizer's setting

    # initializer_range=0.3: scores of order 1, so that a padding error cannot hide in noise
    small = dict(vocab_size=len(vocab), num_labels=1, initializer_range=0.3)
    llama_like = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForSequenceClassification as Model
        small |= llama_like
    elif family == "qwen3":
        from transformers import Qwen3Config as Config
        from transformers import Qwen3ForSequenceClassification as Model
        small |= llama_like | dict(head_dim=8)
    else:  # absolute position embeddings: left padding would change the scores
        from transformers import GPT2Config as Config
        from transformers import GPT2ForSequenceClassification as Model
        small |= dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
                      eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    # pad_token_id left None: RewardModel must take it from the tokenizer
    return Model(Config(**small)).float(), tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_reward_model_batch_equals_single(family):
    model, tokenizer = _tiny_reward_model(family)
    prompts = ["what is 2+2? ", "q: ", "a much longer prompt, to force padding: ", "", "1+1="]
    completions = ["4", "the answer is four.", "x", "only a completion", "2 #### 2"]

    batched = RewardModel(model, tokenizer, batch_size=3)(completions, prompts=prompts)
    single = RewardModel(model, tokenizer, batch_size=1)
    one_at_a_time = [single([c], prompts=[p])[0] for p, c in zip(prompts, completions)]
    assert all(isinstance(s, float) for s in batched)
    torch.testing.assert_close(
        torch.tensor(batched), torch.tensor(one_at_a_time), rtol=1e-5, atol=1e-5
    )
    assert len(set(batched)) == len(batched)  # the scores do depend on the text

    # and it plugs into Rewards like any function (it takes prompts, ignores other columns)
    total, per = Rewards([(RewardModel(model, tokenizer, batch_size=2), 2.0)])(
        completions, prompts, {"answer": completions}
    )
    torch.testing.assert_close(total, 2 * torch.tensor(one_at_a_time), rtol=1e-5, atol=1e-5)


def test_reward_model_pads_with_the_models_pad_id():
    # HF pools the rightmost token that is not the *model's* pad id; the tokenizer's may differ
    model, tokenizer = _tiny_reward_model("llama")
    model.config.pad_token_id = 1  # '<unk>', while the tokenizer pads with '<pad>' = 0
    completions, prompts = ["a", "bcdef", "gh"], ["", "", ""]
    batched = RewardModel(model, tokenizer, batch_size=3)(completions, prompts=prompts)
    single = [RewardModel(model, tokenizer, batch_size=1)([c])[0] for c in completions]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), rtol=1e-5, atol=1e-5)


def test_reward_model_from_folder(tmp_path):
    model, tokenizer = _tiny_reward_model("qwen3")
    expected = RewardModel(model, tokenizer)(["ab", "abc d"], prompts=["q ", "q "])
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loaded = load_reward(f"reward_model:{tmp_path}")
    assert isinstance(loaded, RewardModel)
    torch.testing.assert_close(
        torch.tensor(loaded(["ab", "abc d"], prompts=["q ", "q "])), torch.tensor(expected)
    )
    with pytest.raises(ValueError, match="batch_size=0"):
        RewardModel(model, tokenizer, batch_size=0)


# ------------------------------------------------------------------ TRL's documented reward functions
# The examples of TRL's GRPOTrainer documentation ("Using a custom reward function"), called through
# `Rewards` with the inputs TRL documents for them: they must give the results TRL documents.


def trl_token_length(completions_ids, **kwargs):  # TRL example 1
    return [float(len(ids)) for ids in completions_ids]


def trl_char_length(completions, **kwargs):  # TRL example 1.1 (standard format)
    return [float(len(completion)) for completion in completions]


def trl_think_answer_format(completions, **kwargs):  # TRL example 2 (conversational format)
    import re

    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, completion[0]["content"]) else 0.0 for completion in completions]


def trl_boxed_ground_truth(completions, ground_truth, **kwargs):  # TRL example 3 (standard format)
    import re

    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [m.group(1) if m else "" for m in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def test_trl_documented_examples_standard_format():
    prompts = ["The sky is", "The sun is"]
    completions = [" blue.", " in the sky."]
    ids = [[6303, 13], [304, 279, 12884, 13]]
    _, per = Rewards([(trl_token_length, 1.0), (trl_char_length, 1.0)])(prompts=prompts, completions=completions,
                                                                         columns={}, completions_ids=ids)
    assert per["trl_token_length"].tolist() == [2.0, 4.0] and per["trl_char_length"].tolist() == [6.0, 12.0]
    prompts = ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."]
    total, _ = Rewards([(trl_boxed_ground_truth, 1.0)])(
        [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."], prompts, {"ground_truth": ["2", "5"]})
    assert total.tolist() == [1.0, 0.0]


def test_trl_documented_examples_conversational_format():
    prompts = [[{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}],
               [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}]]
    completions = [[{"role": "assistant", "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get "
                                                     "12.</think><answer>(1 + 2) * 4 = 12</answer>"}],
                   [{"role": "assistant", "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So "
                                                     "(3 + 1) * 2 = 8."}]]
    total, _ = Rewards([(trl_think_answer_format, 1.0)])(completions, prompts, {})
    assert total.tolist() == [1.0, 0.0]
    # the built-ins read the same format: the completion's last message is its text
    total, _ = Rewards([("exact_match", 1.0), ("format:<think>.*", 1.0)])(
        completions, prompts, {"answer": ["nope", "(3 + 1) * 2 = 8."]})
    assert total.tolist() == [1.0, 0.0]


def test_trl_multi_task_none_async_and_array_rewards():
    """TRL example 4: a function returns None where it does not apply and the others score the
    sample; example 5: an async function; numpy arrays, tensors and numpy numbers are rewards."""
    import numpy as np

    def math_only(prompts, completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    def code_only(prompts, completions, task, **kwargs):
        return [None if t == "math" else -1.0 for t in task]

    async def nonempty(prompts, completions, **kwargs):
        return [1.0 if c else 0.0 for c in completions]

    total, per = Rewards([(math_only, 1.0), (code_only, 2.0), (nonempty, 0.5)])(
        ["4", ""], ["2+2?", "def f"], {"task": ["math", "code"]})
    assert total.tolist() == [1.5, -2.0]  # 1 + 0.5·1 ; 2·(−1) + 0.5·0
    assert torch.isnan(per["math_only"][1]) and per["code_only"][1] == -1.0
    for returned in (np.array([0.25, 1]), torch.tensor([0.25, 1.0]), [np.float32(0.25), np.int64(1)]):
        total, _ = Rewards([(lambda completions, **kw: returned, 1.0)])(["a", "b"], ["p", "q"], {})
        assert total.tolist() == [0.25, 1.0]


def test_a_function_without_kwargs_gets_what_it_names():
    """TRL passes every argument to every function; one that names only some gets those."""
    def plain(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    total, _ = Rewards([(plain, 1.0)])(["1", "2"], ["p", "q"], {"answer": ["1", "3"], "level": [0, 1]},
                                       completions_ids=[[1], [2]], trainer_state=R.TrainerState(3, 10))
    assert total.tolist() == [1.0, 0.0]


def test_eval_metrics_against_rewards_known_in_advance():
    """pass@k is "any of the k samples passes", avg@k the mean share that pass, reward/mean the mean
    reward: computed here by hand for three prompts of four samples each (a pass@k taken with `all`
    would give 1/3, not 2/3)."""
    from backstream.rl.data.prompts import DataConfig
    from backstream.rl.parallel.dataparallel import DataParallel
    from backstream.rl.rollout.evaluate import EvalConfig, Evaluator

    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]

    class Fixed(list):  # the samples' indices, as score() gets them; nothing held for the rewards
        def release(self):
            pass

    ev = Evaluator(EvalConfig(every=1, prompts=3, samples=4, pass_reward=1.0), DataConfig(task="arith"), 0,
                   lambda ex, k: None)
    ev.examples = ev.examples[:3]
    sample = lambda rows, indices, gens: Fixed(indices)  # noqa: E731
    out = ev.run(sample, lambda idx: torch.tensor([rewards[i] for i in idx]).flatten(), DataParallel(None), 0)
    assert out == {"eval/reward/mean": 5 / 12, "eval/pass@4": 2 / 3, "eval/avg@4": (1 / 4 + 0 + 1) / 3}


# -- the answer of a chat response (issue 42) -------------------------------------------------------


@pytest.mark.parametrize("text, gold, want", [
    ("37 + 45 = 82.", "82", 1.0), ("The answer is 82", "82", 1.0),
    ("Answer: 82\nI hope that helps, 3 times", "82", 1.0),
    ("**Answer:** 82.", "82", 1.0), ("so \\boxed{82}, not 81", "82", 1.0), ("work #### 1,000", "1000", 1.0),
    ("82 is close, but it is 81", "82", 0.0), ("no number at all", "82", 0.0), ("eighty-two", "82", 0.0),
])
def test_answer_reads_the_answer_of_a_chat_response(text, gold, want):
    from backstream.rl.scoring.builtin import answer

    assert answer([text], [gold]) == [want]
    assert answer([[{"role": "assistant", "content": text}]], [gold]) == [want]


def test_reward_metrics_are_named_by_the_function(tmp_path):
    """reward/<function>, not reward/<path>:<function>; two functions of one name kept apart."""
    from backstream.rl.scoring.builtin import spec_name
    from backstream.rl.scoring.rewards import Rewards

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "r.py").write_text("def correct(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert spec_name(f"{tmp_path}/a/r.py:correct") == "correct"
    assert [spec_name(s) for s in ("exact_match", "answer", "format:\\d+", "reward_model:x", "env", "mod.sub:f")] == [
        "exact_match", "answer", "format", "reward_model", "env", "f"]
    r = Rewards([(f"{tmp_path}/a/r.py:correct", 1.0), (f"{tmp_path}/b/r.py:correct", 0.5), ("exact_match", 1.0)])
    assert list(r.functions) == ["correct", "correct#1", "exact_match"]
