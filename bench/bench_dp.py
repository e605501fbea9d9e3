"""Data parallelism: steps/s and peak memory per rank at 1 and 2 processes, on the long-prompt task.

    python -m bench.bench_dp [--steps 3] [--model default]

The same seeded RL run (the built-in model, `data.task = "kvlookup"`: 4 prompts x 8 samples of a
~1.1K-token prompt per step, partial-credit reward, as bench/bench_steps.py) three ways:
  plain        one process, no torchrun (the sampler draws from one generator);
  torchrun x1  one rank under torchrun (FSDP2 over one rank, one generator per prompt group);
  torchrun x2  two ranks: each samples and trains 2 of the 4 groups, FSDP2-sharded.
torchrun x1 and x2 draw the same samples, so their rewards agree step by step (printed). Each rank
reports its mean step time after the first step (which pays one-off allocations) and its peak
resident memory (ru_maxrss: imports and the model included).

On a 2-core CPU this shows correctness and overhead, not speed-up: the two ranks split the same two
cores the single process uses (each rank gets cores / ranks threads), tiny matmuls gain little
from a second thread anyway, and every step adds the gathers of the rollouts, the all-gathers of
the weights and one reduce-scatter per FSDP unit and optimizer step over gloo on loopback. The
speed-up of data parallelism is a GPU measurement (one rank per GPU, nccl).
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

TASK = ['data.task="kvlookup"', "train.prompts_per_step=4", "data.num_examples=64",
        "reward.functions=['bench.rewards:char_overlap']", "optim.lr=3e-4", "train.progress=false"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    """One rank (or the plain process): train `steps` steps, write this rank's numbers as JSON."""
    import torch

    from backstream import config, trainer
    from backstream.rl.parallel import collectives

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    cfg = config.load(None, [f'model.name="{args.model}"', f"train.steps={args.steps}",
                             f'train.output_dir="{args.out}/run"', *TASK])
    t = trainer.Trainer(cfg)
    times, rewards, split = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = t.train_step()
        times.append(time.perf_counter() - t0)
        rewards.append(m["reward/mean"])
        # this rank's own time split (the metrics line holds rank 0's)
        tt = t.times
        split.append({"rollout": tt["rollout"], "train": tt["prefill"] + tt["backward"] + tt["optim"],
                      "tokens": m["throughput/tokens_per_s"] * m["time/step"]})  # the global batch's
        t.logger.log(m)
    t.close()
    t.run_folder.release()
    rank = collectives.rank()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": collectives.world(), "step_s": times, "rewards": rewards, "split": split,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "threads": torch.get_num_threads()}, f)
    collectives.shutdown()


def launch(mode: str, steps: int, model: str, threads: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"bench_dp_{mode}_")
    me = ["-m", "bench.bench_dp", "--worker", "--out", out, "--steps", str(steps), "--model", model,
          "--threads", str(threads)]
    if mode == "plain":
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", mode[-1], *me]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return sorted((json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.startswith("rank")),
                  key=lambda r: r["rank"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from bench import common

    rows, rewards = [], {}
    for mode in ("plain", "torchrun x1", "torchrun x2"):
        for r in launch(mode.replace(" ", ""), a.steps, a.model, a.threads):
            k = 1 if len(r["step_s"]) > 1 else 0  # the first step pays one-off allocations
            mean = lambda xs: sum(xs[k:]) / len(xs[k:])  # noqa: E731
            step = mean(r["step_s"])
            rows.append({"mode": mode, "rank": r["rank"], "threads": r["threads"], "step_s": round(step, 2),
                         "steps_per_s": round(1 / step, 3),
                         "rollout_s": round(mean([s["rollout"] for s in r["split"]]), 2),
                         "train_s": round(mean([s["train"] for s in r["split"]]), 2),
                         "batch_tokens": round(mean([s["tokens"] for s in r["split"]])),
                         "peak_rss_mib": round(r["peak_rss_mib"])})
            rewards[mode] = r["rewards"]
            print(rows[-1], flush=True)
    print(common.table(rows, ["mode", "rank", "threads", "step_s", "steps_per_s", "rollout_s", "train_s",
                              "batch_tokens", "peak_rss_mib"]))
    same = rewards["torchrun x1"] == rewards["torchrun x2"]
    print(f"reward/mean per step: torchrun x1 {rewards['torchrun x1']}, x2 {rewards['torchrun x2']} "
          f"({'identical' if same else 'DIFFERENT'}); plain {rewards['plain']} (another sampler RNG)")
    print("saved", common.save("dp", {"rows": rows, "rewards": rewards, "steps": a.steps}))


if __name__ == "__main__":
    main()
