"""Step-time breakdown of the built-in tasks, streamed engine vs reference engine, side by side.

    python -m bench.bench_steps [--steps 4] [--model default]

The same seeded RL run (the demo's settings: GRPO, 16 prompts × 8 samples; on kvlookup 4 prompts
× 8 samples of a ~1.1K-token prompt) with `engine.backward = stream` and `= reference`. Mean
seconds per step of each phase; "train" = prefill + backward + optimizer (the part the engine
changes; with the reference engine the log-probs before the update come from its own no-grad pass,
as in every PPO/GRPO trainer). kvlookup is scored with partial credit (bench/rewards.py), since the
default model cannot solve it yet and exact match would give no gradient at all.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from backstream import config, trainer
from bench import common

# kvlookup: partial credit per character, so the (untrained) model's groups have nonzero advantages
TASKS = {"arith": ["train.prompts_per_step=16"],
         "kvlookup": ["train.prompts_per_step=4", "data.num_examples=64",
                      "reward.functions=['bench.rewards:char_overlap']"]}
PHASES = ["rollout", "reward", "prefill", "backward", "optim"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default="default")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp()
    rows = []
    for task, extra in TASKS.items():
        per = {}
        for backward in ("stream", "reference"):
            cfg = config.load(None, [f'model.name="{a.model}"', f'data.task="{task}"', f"train.steps={a.steps}",
                                     "optim.lr=3e-4", "train.progress=false", f'engine.backward="{backward}"',
                                     f'train.output_dir="{tmp}/{task}-{backward}"', *extra])
            t = trainer.Trainer(cfg)
            ms = [t.train_step() for _ in range(a.steps)]
            mean = {p: sum(m[f"time/{p}"] for m in ms) / len(ms) for p in PHASES}
            mean["train"] = mean["prefill"] + mean["backward"] + mean["optim"]
            mean["step"] = sum(m["time/step"] for m in ms) / len(ms)
            mean["tokens"] = sum(m["throughput/tokens_per_s"] * m["time/step"] for m in ms) / len(ms)
            per[backward] = mean
            rows.append({"task": task, "engine": backward, **{k: round(v, 3) for k, v in mean.items()}})
            print(rows[-1], flush=True)
        rows.append({"task": task, "engine": "ratio ref/stream",
                     **{k: round(per["reference"][k] / max(per["stream"][k], 1e-9), 2) for k in per["stream"]}})
    print(common.table(rows, ["task", "engine", "tokens", *PHASES, "train", "step"]))
    print("saved", common.save("steps", rows))


if __name__ == "__main__":
    main()
