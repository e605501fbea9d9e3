"""100-step float32 replay: the same seeded RL run with the streamed and the reference engine, in
lockstep, and the relative weight drift between them after every step.

    python -m bench.bench_replay [--steps 100]

A tiny random Qwen3 with the default character tokenizer and a reward that varies for a random
model (fraction of '1' characters), so every step has a gradient. float32 rounding differs between
the two paths (block-wise vs full-sequence sums); the drift shows how that compounds over steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from backstream import config, trainer
from bench import common


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(2)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_trainer import tiny

    tmp = tempfile.mkdtemp()
    runs = {}
    for backward in ("stream", "reference"):
        model, tok = tiny(torch.float32)
        cfg = config.load(None, [
            'model.dtype="float32"', f"train.steps={a.steps}", "train.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "data.num_examples=64", "optim.lr=3e-3", "train.progress=false",
            "reward.functions=['rewards_for_tests:count_ones']", f'engine.backward="{backward}"', "engine.block_size=4",
            f'train.output_dir="{tmp}/{backward}"'])
        runs[backward] = trainer.Trainer(cfg, model=model, tokenizer=tok)
    rows = []
    for step in range(1, a.steps + 1):
        m = {k: t.train_step() for k, t in runs.items()}
        ws, wr = (t.model.state_dict() for t in runs.values())
        drift = (sum(float((ws[k] - wr[k]).double().norm() ** 2) for k in ws) ** 0.5
                 / sum(float(wr[k].double().norm() ** 2) for k in wr) ** 0.5)
        rows.append({"step": step, "weight_drift": f"{drift:.2e}",
                     "reward_stream": round(m["stream"]["reward/mean"], 3),
                     "reward_reference": round(m["reference"]["reward/mean"], 3)})
        if step in (1, 2, 5, 10, 20, 50, 100) or step == a.steps:
            print(rows[-1], flush=True)
    shown = [r for r in rows if r["step"] in (1, 2, 5, 10, 20, 50, 100)]
    print(common.table(shown, ["step", "weight_drift", "reward_stream", "reward_reference"]))
    print("saved", common.save("replay", rows))


if __name__ == "__main__":
    main()
