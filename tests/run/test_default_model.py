"""The shipped default model and tokenizer: they load like any HF model, match their documented
definition, fit the size budget, answer arith prompts in the expected format, and play toolcalc
episodes in the plain tool-call format, calling the tool part of the time."""

import functools

import pytest
import torch

from backstream.default_model import (
    CHARS,
    DEFAULT_MODEL_DIR,
    SPECIAL_TOKENS,
    build_tokenizer,
    default_config,
    load_default,
)
from backstream.rl.data.tasks import TASKS, make_dataset
from backstream.rl.scoring.builtin import exact_match


@functools.cache
def shipped():
    return load_default()


def test_assets_fit_the_size_budget():
    files = [f for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file()]
    names = {f.name for f in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(f.stat().st_size for f in files) <= 5_000_000


def test_tokenizer_loads_with_auto_tokenizer_and_matches_its_definition():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    assert tok.get_vocab() == build_tokenizer().get_vocab()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS) == 100
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == SPECIAL_TOKENS
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)


@pytest.mark.parametrize("task", ["arith", "kvlookup", "toolcalc"])
def test_tokenizer_round_trip(task):
    _, tok = shipped()
    texts = [r["prompt"] + r["answer"] for r in make_dataset(task, 3)]
    texts += [CHARS, "  two spaces, a\nnewline and {braces} ~!"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character, no BOS/EOS added
        assert tok.decode(ids) == text


def test_tokenizer_special_tokens_and_unknown_characters():
    _, tok = shipped()
    ids = tok("12")["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "12<eos><pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "12"
    assert tok("<eos>")["input_ids"] == [tok.eos_token_id]  # special tokens are matched whole
    assert tok("a\tb")["input_ids"][1] == tok.unk_token_id
    batch = tok(["1+1=", "10+10="], padding=True, padding_side="left", return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]


def test_model_config_is_as_documented():
    model, tok = shipped()
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    expected = default_config().to_dict()
    for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
        "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
    ):
        assert getattr(cfg, key) == expected[key], key
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 32, 384)
    assert cfg.max_position_embeddings >= 4096 and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 0.9e6
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_load_default_dtype():
    model, _ = load_default(torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


@torch.no_grad()
def test_greedy_arith_answers_are_digits_then_eos():
    model, tok = shipped()
    rows = make_dataset("arith", 16, seed=5)
    ids = torch.tensor([tok(r["prompt"])["input_ids"] for r in rows])  # all 6 characters long
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6
    )
    right = 0
    for row, completion in zip(rows, out[:, ids.shape[1] :].tolist()):
        assert tok.eos_token_id in completion, tok.decode(completion)
        body = tok.decode(completion[: completion.index(tok.eos_token_id)])
        assert body.isdigit() and 1 <= len(body) <= 3, body
        right += body == row["answer"]
    # greedy decoding knows most answers (temperature-1 sampling far fewer: room for RL)
    assert right >= len(rows) // 2


def play_toolcalc(rows, temperature: float, group_size: int):
    """toolcalc episodes of the shipped model through the trainer's episode sampler, with the task's
    defaults (environment, turns, turn budget): per episode (tool calls, tool errors, turns, reward)."""
    from backstream.rl.agent.env import EnvConfig, Environment
    from backstream.rl.backends.base import SamplingParams
    from backstream.rl.backends.local.backend import LocalBackend
    from backstream.rl.rollout.episodes import EpisodeSampler

    model, tok = shipped()
    d = TASKS["toolcalc"].defaults
    config = SamplingParams(temperature=temperature, max_new_tokens=d["rollout.max_new_tokens"])
    backend = LocalBackend(config, [tok.eos_token_id], tok)
    backend.weights.sync(model, 0)
    env = EnvConfig(factory=d["env.factory"], max_turns=d["env.max_turns"])
    environment = Environment.load(env)
    sampler = EpisodeSampler(config, group_size, env, environment, tok, [tok.eos_token_id], False, None, backend)
    gens = [torch.Generator().manual_seed(i) for i in range(len(rows))]
    r = sampler.sample(rows, list(range(len(rows))), gens).samples
    out = []
    completions, _, _ = sampler.reward_inputs(r, [rows[i] for i in r.prompt_index])
    for i, (e, messages) in enumerate(zip(r.episodes, completions)):
        answer = rows[r.prompt_index[i]]["answer"]
        out.append((e.tool_calls, e.tool_errors, e.turns, exact_match([messages], [answer])[0]))
    sampler.close()
    environment.close()
    return out


@torch.no_grad()
def test_toolcalc_greedy_episodes_call_the_tool_in_the_plain_format():
    """Greedy decoding calls the tool in part of the episodes (its first token "[" outweighs any one
    first digit of a direct answer in about half of them); where it does, it makes the two
    well-formed calls of `tasks.toolcalc_episode` and answers, mostly right."""
    episodes = play_toolcalc(make_dataset("toolcalc", 32, seed=5), temperature=0.0, group_size=1)
    with_tool = [e for e in episodes if e[0] > 0]
    assert len(with_tool) >= len(episodes) // 4
    assert sum(e[:3] == (2, 0, 3) for e in with_tool) >= 0.9 * len(with_tool)  # 2 calls, no error, 3 turns
    assert sum(e[3] for e in with_tool) >= 0.7 * len(with_tool)


@pytest.mark.slow
@torch.no_grad()
def test_toolcalc_sampled_episodes_leave_room_for_rl():
    """At temperature 1 the model calls the tool in only part of the episodes and is right more often
    with it than without, but far from always: RL can raise both the calls and the reward."""
    episodes = play_toolcalc(make_dataset("toolcalc", 16, seed=6), temperature=1.0, group_size=8)
    with_tool = [e for e in episodes if e[0] > 0]
    direct = [e for e in episodes if e[0] == 0]
    assert 0.2 * len(episodes) <= len(with_tool) <= 0.6 * len(episodes), len(with_tool)
    right_with, right_without = (sum(e[3] for e in part) / len(part) for part in (with_tool, direct))
    assert right_without < right_with < 0.6, (right_with, right_without)
