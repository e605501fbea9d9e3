"""backstream against TRL's GRPOTrainer on a real chat model (issue 42), back to back, on the same work.

The model: SmolLM2-135M-Instruct (`bench/real_model.py`: from its PyPI package, no Hub), float32 on CPU.
The work, the same on both sides: the built-in arith task through the model's chat template ("What is
37+45? Answer with the number only.", data.format = "chat"), 4 prompts a step from the same seeded
prompt list, G = 8 samples each at temperature 1, at most 48 new tokens, scored by the "answer"
reward (the answer in the reply), GRPO advantages (group mean and std), a token-mean clipped
objective (eps 0.2; TRL: loss_type "dapo", scale_rewards "group", beta 0), AdamW at a constant 2e-5,
betas (0.9, 0.99), no weight decay, gradient norm clipped at 1.0. Each side runs in a fresh process
(its peak resident set is its own, `ru_maxrss`); the machine runs nothing else meanwhile.

Measured: seconds per step (the mean over the steps after the first, which pays one-off costs), the
peak resident set, and the reward curve (mean reward of each step). TRL is a bench dependency only
(`pip install trl`).

    python -m bench.bench_real [--steps 20] [--sides backstream,trl]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench import common

STEPS, PROMPTS, G, NEW, LR, SEED = 20, 4, 8, 48, 2e-5, 0


def rows(n: int) -> list[dict]:
    from backstream.rl.tasks import TASKS, make_dataset

    return [{"prompt": [{"role": "user", "content": TASKS["arith"].chat(r)}], "answer": r["answer"]}
            for r in make_dataset("arith", n, SEED)]


def side_backstream(steps: int, out: str) -> dict:
    from backstream import config, trainer
    from bench.real_model import real_model_dir

    data = os.path.join(out, "arith_chat.jsonl")
    with open(data, "w") as f:
        for r in rows(PROMPTS * steps):
            f.write(json.dumps(r) + "\n")
    cfg = config.load(None, [f'model.name="{real_model_dir()}"', f'data.path="{data}"', "reward.functions=['answer']",
                             f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}", f"rollout.group_size={G}",
                             f"rollout.max_new_tokens={NEW}", f"optim.lr={LR}", "optim.betas=[0.9, 0.99]",
                             f"train.seed={SEED}", "train.progress=false", "train.plots=false",
                             f'train.output_dir="{os.path.join(out, "run")}"'])
    run = trainer.train(cfg)
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    return {"step_s": [x["time/step"] for x in lines], "reward": [x["reward/mean"] for x in lines]}


def side_trl(steps: int, out: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from backstream.rl.rewards import answer
    from bench.real_model import real_model_dir

    folder = real_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    ds = Dataset.from_list(rows(PROMPTS * steps))

    def reward_answer(completions, answer_col=None, **kw):
        return answer(completions, kw["answer"])

    reward_answer.__name__ = "answer"
    args = GRPOConfig(output_dir=os.path.join(out, "trl"), per_device_train_batch_size=PROMPTS * G,
                      num_generations=G, max_completion_length=NEW, learning_rate=LR, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
                      beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", temperature=1.0,
                      max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                      seed=SEED, shuffle_dataset=False, gradient_accumulation_steps=1)
    times, rewards, last = [], [], [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = GRPOTrainer(model=model, reward_funcs=[reward_answer], args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    last[0] = time.perf_counter()
    trainer.train()
    return {"step_s": times, "reward": rewards}


def child(side: str, steps: int) -> None:
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        res = (side_backstream if side == "backstream" else side_trl)(steps, out)
    res["peak_rss_MiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps(res), flush=True)


def run_side(side: str, steps: int) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.bench_real", "--child", side, "--steps", str(steps)],
                          capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{side} failed: {proc.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["wall_s"] = round(time.perf_counter() - t, 1)
    later = res["step_s"][1:] or res["step_s"]
    res["s_per_step"] = round(sum(later) / len(later), 2)
    r = res["reward"]
    k = min(5, len(r) // 2)
    res["reward_first"], res["reward_last"] = round(sum(r[:k]) / k, 3), round(sum(r[-k:]) / k, 3)
    print(json.dumps({"side": side, **{x: res[x] for x in ("s_per_step", "peak_rss_MiB", "reward_first",
                                                            "reward_last", "wall_s")}}), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--sides", default="backstream,trl")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.steps)
        return
    from bench.real_model import real_model_dir

    real_model_dir()  # built before either side is timed
    res = {"steps": a.steps, "prompts": PROMPTS, "G": G, "max_new_tokens": NEW, "lr": LR, "sides": {}}
    for side in a.sides.split(","):
        res["sides"][side] = run_side(side, a.steps)
    sides = res["sides"]
    if {"backstream", "trl"} <= set(sides):
        res["speedup"] = round(sides["trl"]["s_per_step"] / sides["backstream"]["s_per_step"], 2)
        res["peak_ratio"] = round(sides["backstream"]["peak_rss_MiB"] / sides["trl"]["peak_rss_MiB"], 3)
    rows_ = [{"side": k, **{x: v[x] for x in ("s_per_step", "peak_rss_MiB", "reward_first", "reward_last")}}
             for k, v in sides.items()]
    print(common.table(rows_, list(rows_[0])))
    print({k: res.get(k) for k in ("speedup", "peak_ratio")})
    print("saved", common.save("real", res))


if __name__ == "__main__":
    main()
