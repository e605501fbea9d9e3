"""Agentic episodes a TRL user can trust (issue 25): each defect of the issue, played.

- the final answer is the policy's: a call at a limit is not run, a cut turn stays in the messages
  (marked `finish_reason`), the built-in rewards score the last assistant message, no answer scores 0;
- templates checked before the run; tool markers read from the ids; an unclosed call is malformed;
- tools that really stop (a worker process killed at the timeout, the environment discarded), reset
  with a timeout, results capped;
- TRL's contract: completion_ids, log_metric / log_extra, get_reward added, async tools and rewards,
  str() of other results, reset's text on the last user message and in the prompts, an environment
  that owns its data, a tool named `step`;
- seeing episodes: episodes.jsonl, the progress line, eval lines.
"""

import json
import os
import threading

import pytest
import torch
from helpers import CHAT_TEMPLATE, episode_sampler, info, run_cfg, sample, sampler, text, tiny

from backstream import trainer
from backstream.metrics import Logger
from backstream.rl.agent.env import EnvConfig, EnvError
from backstream.rl.agent.process import EnvDiscarded, wait_dead
from backstream.rl.backends.base import SamplingParams
from backstream.rl.scoring.builtin import env_reward, exact_match, format_reward
from backstream.rl.scoring.rewards import RewardLog, Rewards


def rewards_see(s, r, rows):
    """What reward functions receive for a rollout: (completions, prompts, extra)."""
    return s.reward_inputs(r, rows)


# -- 1. the final answer is the policy's ------------------------------------------------------------------


def test_a_call_at_max_turns_is_not_run_and_scores_no_answer(script):
    """env.max_turns = 2, the second turn a tool call: the call is not run (the environment saw one
    call), it is the last message, marked "turns", and exact_match gives 0 (the previous code ran it
    and scored its result, which the policy never saw: 7 of 9 rewarded toolcalc episodes)."""
    model, tok = tiny(torch.float32)
    s = sampler(tok, G=1, max_turns=2)
    script([["[add 1 2]<eos>", "[add 3 4]<eos>"]])
    r = sample(s, model, [{"prompt": "1+2+4=", "answer": "7"}])
    completions, _, extra = rewards_see(s, r, [{"prompt": "1+2+4=", "answer": "7"}])
    assert r.finish_reason == ["turns"] and info(r, "tool_calls") == [1]
    assert r.episodes[0].env.calls == 1  # the second call never ran
    last = completions[0][-1]
    assert last["role"] == "assistant" and last["tool_calls"] and last["finish_reason"] == "turns"
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert exact_match(completions, ["7"]) == [0.0]
    assert env_reward(extra["environments"]) == [1.0]


def test_a_cut_first_turn_is_in_the_messages_and_scores(script):
    """rollout.max_new_tokens cuts the first turn: the reward functions get it (never `[]`, which
    made exact_match raise a TypeError at step 1), marked "length"."""
    model, tok = tiny(torch.float32)
    s = sampler(tok, G=2, max_new=2)
    script([["12345<eos>"], ["98765<eos>"]])
    r = sample(s, model, [{"prompt": "6+6=", "answer": "12"}])
    completions, _, _ = rewards_see(s, r, [{"prompt": "6+6=", "answer": "12"}] * 2)
    assert completions == [[{"role": "assistant", "content": "12", "finish_reason": "length"}],
                           [{"role": "assistant", "content": "98", "finish_reason": "length"}]]
    assert exact_match(completions, ["12", "12"]) == [1.0, 0.0]


def test_a_cut_later_turn_is_scored_not_the_tool_result_before_it(script):
    """A later turn cut by rollout.max_new_tokens: the rewards read it, not the previous tool result
    (which here equals the answer: the previous code gave 1.0)."""
    model, tok = tiny(torch.float32)
    s = sampler(tok, G=1, max_new=10)
    script([["[add 1 2]<eos>", "999999999999<eos>"]])
    r = sample(s, model, [{"prompt": "1+2=", "answer": "3"}])
    completions, _, _ = rewards_see(s, r, [{"prompt": "1+2=", "answer": "3"}])
    assert completions[0][-1] == {"role": "assistant", "content": "9999999999", "finish_reason": "length"}
    assert completions[0][-2] == {"role": "tool", "name": "add", "content": "3"}
    assert exact_match(completions, ["3"]) == [0.0] and format_reward(r"\d+")(completions) == [1.0]


def test_the_episode_token_limit_runs_no_call_it_has_no_room_to_show(script):
    model, tok = tiny(torch.float32)
    s = sampler(tok, G=1, max_episode_tokens=16)
    script([["[add 1 2]<eos>"]])
    r = sample(s, model, [{"prompt": "1+2=", "answer": "3"}])
    completions, _, extra = rewards_see(s, r, [{"prompt": "1+2=", "answer": "3"}])
    assert r.finish_reason == ["length"] and r.episodes[0].env.calls == 0
    assert completions[0][-1]["tool_calls"] and completions[0][-1]["finish_reason"] == "length"
    assert exact_match(completions, ["3"]) == [0.0] and len(r.prompt_ids[0]) + len(r.completion_ids[0]) <= 16


def test_no_answer_scores_zero_in_every_built_in():
    no_answer = [[{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add"}}]}], []]
    tool_last = [[{"role": "assistant", "content": "7"}, {"role": "tool", "name": "add", "content": "7"}]]
    assert exact_match(no_answer + tool_last, ["", "", "7"]) == [0.0, 0.0, 0.0]
    assert format_reward(r".*")(no_answer) == [0.0, 0.0]


# -- 2. templates checked before the run, parses ------------------------------------------------------------

# Renders an assistant turn with "<think></think>" only when it is the conversation's last message, as
# Qwen3's stock template treats reasoning: the history is not a prefix once a turn follows.
LAST_ONLY = CHAT_TEMPLATE.replace("<a>{{ m['content'] }}", "<a>{% if loop.last %}<think></think>{% endif %}"
                                                          "{{ m['content'] }}")


def test_a_template_that_rewrites_history_is_refused_at_start_up():
    model, tok = tiny(torch.float32)
    tok.chat_template = LAST_ONLY
    with pytest.raises(ValueError, match="renders the conversation before the tool results differently.*"
                                         "env.chat_template"):
        sampler(tok, G=1, format="chat")
    s = sampler(tok, G=1, format="chat", chat_template=CHAT_TEMPLATE)  # the fix the message names
    assert s.format.template == CHAT_TEMPLATE


def test_tool_markers_that_are_special_tokens_are_read_and_unclosed_calls_are_malformed():
    model, tok = tiny(torch.float32)
    tok.chat_template = CHAT_TEMPLATE
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    s = sampler(tok, G=1, format="chat")
    ids = tok('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><eos>',
              add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<tool_call>") in ids  # one token, which decoding would skip
    msg, calls = s.format.parse(ids)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})] and msg["content"] == ""
    msg, calls = s.format.parse(tok('I will add. <tool_call>{"name": "add", "argu<eos>',
                                    add_special_tokens=False)["input_ids"])
    assert len(calls) == 1 and "unclosed tool call" in calls[0].error and msg["content"] == "I will add."


# -- 3. tools that really stop ------------------------------------------------------------------------------


def test_a_spinning_tool_is_killed_and_its_environment_discarded(script):
    """A tool that spins the CPU past env.tool_timeout_s: its worker process is killed (no thread
    left behind, nothing mutates the environment afterwards), the episode ends on the call with a
    counted error, the env reward is 0 and reading the environment says it was discarded."""
    model, tok = tiny(torch.float32)
    threads = threading.active_count()
    s = sampler(tok, "envs_for_tests:Spin", G=1, tool_timeout_s=0.5)
    script([["[spin 1]<eos>", "never<eos>"]])
    r = sample(s, model, [{"prompt": "go"}])
    env = r.episodes[0].env
    assert r.finish_reason == ["timeout"] and info(r, "tool_errors") == [1] and info(r, "timed_out") == [True]
    assert env.discarded and wait_dead(env) and threading.active_count() == threads
    assert env_reward([env]) == [0.0]
    with pytest.raises(EnvDiscarded, match="discarded after a request to it overran env.tool_timeout_s"):
        env.count
    assert s.metrics(r)["episode/timeouts"] == 1.0
    s.close()


def test_a_reset_that_overruns_stops_the_step_naming_it():
    model, tok = tiny(torch.float32)
    s = sampler(tok, "envs_for_tests:SlowReset", G=1, tool_timeout_s=0.3)
    with pytest.raises(EnvError, match=r"SlowReset.reset did not return within env.tool_timeout_s = 0.3 on row 0"):
        sample(s, model, [{"prompt": "p"}])


def test_tool_results_are_capped_with_a_marker_and_counted(script):
    model, tok = tiny(torch.float32)
    s = sampler(tok, "envs_for_tests:Big", G=1, max_result_tokens=20, max_new=16)
    script([["[dump 10]<eos>", "ok<eos>"]])
    r = sample(s, model, [{"prompt": "p"}])
    completions, _, _ = rewards_see(s, r, [{"prompt": "p"}])
    result = completions[0][1]["content"]
    assert result == "x" * 20 + "[... 9999980 more characters cut]" and info(r, "results_cut") == [1]
    assert text(tok, r, 0) == "p[dump 10]<eos>\n=" + result + "\nok<eos>"  # what the policy read
    # a result cut further to fit the episode's token limit, the next turn still has room
    script([["[dump 1]<eos>", "ok<eos>"]])
    r = sample(sampler(tok, "envs_for_tests:Big", G=1, max_result_tokens=2000, max_new=16, max_episode_tokens=120),
               model, [{"prompt": "p"}])
    assert info(r, "results_cut") == [1] and len(r.prompt_ids[0]) + len(r.completion_ids[0]) <= 120
    assert "more characters cut]" in text(tok, r, 0)


# -- 4. TRL's contract in full ----------------------------------------------------------------------------


def test_async_tools_async_get_reward_other_results_and_a_tool_named_step(script):
    model, tok = tiny(torch.float32)
    s = sampler(tok, "envs_for_tests:TrlShapes", G=1)
    assert sorted(x["function"]["name"] for x in s.env.schemas) == ["add", "as_numpy", "point", "step"]
    script([["[add 2 3]<eos>", "[as_numpy 7]<eos>", "[point 4]<eos>", '[step "hi"]<eos>', "5<eos>"]])
    r = sample(s, model, [{"prompt": "2+3="}])
    assert text(tok, r, 0) == ("2+3= [ready][add 2 3]<eos>\n=5\n[as_numpy 7]<eos>\n=7\n[point 4]<eos>\n=Point(4)\n"
                               '[step "hi"]<eos>\n=hi\n5<eos>')
    assert info(r, "tool_errors") == [0] and env_reward(info(r, "env")) == [5.0]  # awaited
    assert s.env.has_reward and not s.env.has_response


def test_reset_text_goes_on_the_last_user_message_and_into_the_prompts(script):
    model, tok = tiny(torch.float32)
    tok.chat_template = CHAT_TEMPLATE
    s = sampler(tok, "envs_for_tests:TrlShapes", G=1, format="chat")
    prompt = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "2+3="}]
    script([["5<eos>"]])
    r = sample(s, model, [{"prompt": prompt}])
    _, prompts, _ = rewards_see(s, r, [{"prompt": prompt}])
    assert prompts[0][0]["content"] == "first" and prompts[0][-1]["content"] == "2+3= [ready]"
    assert "<u>2+3= [ready]</u>" in text(tok, r, 0)
    script([["5<eos>"]])
    plain = sampler(tok, "envs_for_tests:TrlShapes", G=1, format="plain")
    r = sample(plain, model, [{"prompt": "2+3="}])
    assert rewards_see(plain, r, [{"prompt": "2+3="}])[1] == ["2+3= [ready]"]


def test_get_reward_is_added_with_a_line_and_env_named_without_one_is_refused(capsys):
    model, tok = tiny(torch.float32)
    s = sampler(tok, "envs_for_tests:Calc", G=1)
    rewards = Rewards([("exact_match", 1.0)], environment=s.environment)
    assert rewards.weights == {"exact_match": 1.0, "env": 1.0}
    assert "Calc.get_reward() is the reward 'env' with weight 1" in capsys.readouterr().err
    assert Rewards([("env", 0.0)], environment=s.environment).weights == {"env": 0.0}  # named: as given
    with pytest.raises(ValueError, match="IncrementEnv has none"):
        Rewards([("env", 1.0)], environment=sampler(tok, "envs_for_tests:IncrementEnv", G=1).environment)
    with pytest.raises(ValueError, match="the run has no environment"):
        Rewards([("env", 1.0)], environment=None)


def test_log_metric_and_log_extra_reach_the_log():
    def scored(completions, log_metric, log_extra, **kw):
        log_metric("lengths", 2.0)
        log_extra("note", [f"n{i}" for i in range(len(completions))])
        return [1.0] * len(completions)

    log = RewardLog()
    Rewards([(scored, 1.0)])(["a", "b"], ["p", "q"], {}, completion_ids=[[1], [2]], log=log)
    assert log.means() == {"reward_log/lengths": 2.0} and log.columns == {"note": ["n0", "n1"]}


def test_an_environment_that_owns_its_data_and_the_episode_log(tmp_path):
    """Rows with no prompt column: reset's text is the task. The trainer adds get_reward, passes
    completion_ids and log_metric/log_extra, and writes train.log_episodes whole episodes a step."""
    data = tmp_path / "levels.jsonl"
    data.write_text("".join(json.dumps({"level": k}) + "\n" for k in (1, 2, 3, 4)))
    reward = tmp_path / "rw.py"
    reward.write_text("def r(completions, completion_ids, log_metric, log_extra, **kw):\n"
                      "    log_metric('turns', 1.0)\n"
                      "    log_extra('ids', [len(x) for x in completion_ids])\n"
                      "    return [0.0] * len(completions)\n")
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "own", 'model.dtype="float32"', f'data.path="{data}"',
                                'env.factory="envs_for_tests:OwnsItsData"', "rollout.max_new_tokens=12",
                                "rollout.group_size=2", "train.prompts_per_step=2", "train.steps=2",
                                f"reward.functions=['{reward}:r']", "train.log_episodes=3"),
                        model=model, tokenizer=tok)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert all(1.0 <= row["reward/env"] <= 4.0 for row in rows)  # get_reward: the row's level
    assert all(row["reward_log/turns"] == 1.0 for row in rows)
    episodes = [json.loads(x) for x in open(os.path.join(run, "episodes.jsonl"))]
    assert [e["step"] for e in episodes] == [1, 1, 1, 2, 2, 2]
    for e in episodes:
        level = int(e["prompt"].split("+")[0])
        assert e["prompt"] == f"{level}+{level}=" and e["rewards"]["env"] == float(level)
        assert isinstance(e["extra"]["ids"], int) and e["extra"]["ids"] >= 1
        assert set(e["rewards"]) == {"r", "env"} and e["finish_reason"] in ("eos", "length", "turns")
        assert e["tokens"][0]["sampled"] and e["episode"]["turns"] >= 1


# -- 5. seeing the run --------------------------------------------------------------------------------------


def test_progress_lines_show_episodes_tools_and_read_as_eval_lines(tmp_path):
    log = Logger(str(tmp_path), progress=False, total_steps=10)
    assert log.line({"step": 0, "eval/reward/mean": 0.25, "eval/pass@4": 0.5, "eval/avg@4": 0.25}) == \
        "eval at step 0/10 | reward/mean 0.250 | pass@4 0.500 | avg@4 0.250"
    line = log.line({"step": 3, "reward/mean": 0.5, "response_length/mean": 9.0, "episode/turns/mean": 2.5,
                     "episode/tool_calls/mean": 1.25, "episode/tool_errors/mean": 0.125, "time/step": 17.7,
                     "time/rollout": 3.0, "time/tool": 13.0, "time/reward": 0.1, "time/prefill": 0.6,
                     "time/backward": 1.0, "throughput/tokens_per_s": 100, "memory/peak_mib": 512,
                     "eval/pass@4": 0.75})
    assert "turns 2.5 calls 1.25 err 0.12" in line and "tool 13.0s" in line and "eval pass@4 0.750" in line
    log.close()


def test_the_trainer_builds_rewards_with_the_environment(tmp_path):
    model, tok = tiny(torch.float32)
    t = trainer.Trainer(run_cfg(tmp_path, "t", 'model.dtype="float32"', 'data.task="toolcalc"', "train.steps=1",
                                'env.factory="envs_for_tests:Calc"'), model=model, tokenizer=tok)
    assert list(t.parts.rewards.functions) == ["count_ones", "env"] and "reward/env" in t.metric_keys()
    t.run_folder.release()
    t.close()


def test_the_episode_sampler_protocol():
    """In process, an episode's tools are a phase of the round's own ("tool"); its metrics are the keys it
    names; a scored sample hands its environment back (`Samples.release`), and `close` what was never
    scored."""
    model, tok = tiny(torch.float32)
    s = episode_sampler(tok, SamplingParams(max_new_tokens=4), EnvConfig(factory="envs_for_tests:Calc"), group_size=1)
    s.backend.weights.sync(model, 0)
    got = s.sample([{"prompt": "1+2="}], [0], [torch.Generator().manual_seed(0)])
    assert got.seconds == {"tool": sum(e.tool_seconds for e in got.samples.episodes)} and s.environment is s.env
    assert list(s.metrics(got.samples)) == list(s.metric_keys)
    (held,) = [e.hold for e in got.samples.episodes]
    assert not held.released and s.live == [held]
    got.samples.release()
    assert held.released
    again = s.sample([{"prompt": "2+2="}], [0], [torch.Generator().manual_seed(0)]).samples
    assert s.live == [again.episodes[0].hold]  # the released one is no more held
    s.close()
    assert again.episodes[0].hold.released
