"""Low-bit rollouts (QaRL, docs/design.md §6): sampler speed per format, and the paper's comparison at small scale.

    python -m bench.bench_quant speed [--layers 28] [--new 32] [--group 8]
    python -m bench.bench_quant compare [--steps 60]

speed: tokens/s of the in-process sampler (`backends.local.generate`, G rows, one prefill per prompt)
  on a random model of Qwen3-0.6B's shape (28 layers, hidden 1024, MLP 3072, 16 heads / 8 K/V
  heads of 128, vocabulary 151,936, tied LM head), float32 against each low-bit format, timed side
  by side (best of 3 round-robin rounds). The LM head stays in float32 in every format (it is
  never quantized), so it bounds the speed-up: at G = 8 it is ~27% of the float32 multiply-adds.
compare: the paper's comparison on the built-in default (arith task, the demo's settings, the same
  seed and steps for every run): float32 GRPO; W8A8 rollouts with a full-precision learner (GRPO,
  the "quantized rollout training" baseline); W8A8 QaRL (aligned learner) + TBPO; and the same two
  for W4A16. Reward and sampler/learner mismatch curves in one PNG (docs/quant_compare.png), a table
  in bench/results/quant_compare.json. Two minibatches per rollout batch in every run, so that
  TBPO's trust band (on π_θ/π_old, which is 1 at the first update of a batch) has something to bound.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from backstream.quant.linear import QuantConfig, quantize_model, quantized
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.generate import generate
from bench.common import RESULTS, timed_side_by_side

FORMATS = ["w8a8", "w4a16", "fp8"]


def qwen3_06b_shape(layers: int = 28) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float().eval()


def speed(a) -> dict:
    # one model per format, the same random weights (≈ 2.4 GB each in float32 at 28 layers)
    models = {"float32": qwen3_06b_shape(a.layers)}
    for fmt in FORMATS:
        models[fmt] = qwen3_06b_shape(a.layers)
        quantize_model(models[fmt], QuantConfig(rollout=fmt, group_size=128))
        for m in models[fmt].modules():  # weight codes once, outside the timing (once per optimizer step in training)
            if hasattr(m, "qweight"):
                m.qweight()
    prompt = torch.randint(3, 151936, (a.prompt,), generator=torch.Generator().manual_seed(1))
    sc = SamplingParams(max_new_tokens=a.new, temperature=1.0)

    def run(fmt):
        def go():
            with quantized(models[fmt], fmt != "float32"):
                generate(models[fmt], [prompt], sc, group_size=a.group, eos_token_id=None,
                         generator=torch.Generator().manual_seed(0))
        return go

    best = timed_side_by_side({f: run(f) for f in ["float32", *FORMATS]}, rounds=3)
    tokens = a.group * a.new
    out = {"model": f"Qwen3-0.6B shape, {a.layers} layers, random weights, float32 master",
           "group_size": a.group, "prompt_tokens": a.prompt, "new_tokens": a.new, "threads": torch.get_num_threads(),
           "tokens_per_s": {f: tokens / t for f, t in best.items()},
           "speedup_vs_float32": {f: best["float32"] / t for f, t in best.items()}}
    print(json.dumps(out, indent=1))
    with open(os.path.join(RESULTS, "quant_speed.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


RUNS = {  # name -> overrides on the demo's settings
    "float32 GRPO": [],
    "W8A8 rollout, GRPO": ['quant.rollout="w8a8"'],
    "W8A8 QaRL + TBPO": ['quant.rollout="w8a8"', "quant.aligned=true", 'loss.type="tbpo"'],
    "W4A16 rollout, GRPO": ['quant.rollout="w4a16"', "quant.group_size=32"],
    "W4A16 QaRL + TBPO": ['quant.rollout="w4a16"', "quant.group_size=32", "quant.aligned=true", 'loss.type="tbpo"'],
}


def compare(a) -> dict:
    from backstream import config, metrics, trainer
    from backstream.cli import DEMO

    tmp = tempfile.mkdtemp()
    curves = {}
    for i, (name, extra) in enumerate(RUNS.items()):
        cfg = config.load(None, [f"train.steps={a.steps}", "train.progress=false", "update.minibatches=2",
                                 f'train.output_dir="{tmp}/run{i}"', *extra], base=DEMO)
        run_dir = trainer.train(cfg)
        curves[name] = metrics.read(run_dir)
        last = curves[name][-5:]
        print(f"{name}: reward last 5 {sum(r['reward/mean'] for r in last) / len(last):.3f}", flush=True)

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None  # (JSON has no NaN)

    table = {name: {"reward_first5": mean(rows[:5], "reward/mean"), "reward_last5": mean(rows[-5:], "reward/mean"),
                    "mismatch_kl_mean": mean(rows, "mismatch/kl"),
                    "abs_log_ratio_mean": mean(rows, "mismatch/abs_log_ratio/mean"),
                    "ratio_max": max((r.get("mismatch/ratio/max", 0.0) for r in rows), default=0.0),
                    "tbpo_masked_frac": mean(rows, "tbpo/masked_frac"),
                    "rollout_s_per_step": mean(rows, "time/rollout")}
             for name, rows in curves.items()}
    out = {"steps": a.steps, "settings": "demo (arith, 16 prompts x 8, AdamW 3e-4) + update.minibatches=2",
           "table": table}
    print(json.dumps(out, indent=1))
    with open(os.path.join(RESULTS, "quant_compare.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(curves, os.path.join(os.path.dirname(__file__), "..", "docs", "quant_compare.png"))
    return out


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        ax1.plot(steps, [r["reward/mean"] for r in rows], label=name)
        ax2.plot(steps, [max(r.get("mismatch/kl", 0.0), 1e-12) for r in rows], label=name)
    ax1.set(xlabel="step", ylabel="mean reward", title="reward (arith, default model)")
    ax2.set(xlabel="step", ylabel="k3 KL(sampler ‖ learner) per token", yscale="log", title="sampler/learner mismatch")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--layers", type=int, default=28)
    s.add_argument("--new", type=int, default=32)
    s.add_argument("--group", type=int, default=8)
    s.add_argument("--prompt", type=int, default=64)
    c = sub.add_parser("compare")
    c.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    torch.set_num_threads(2)
    speed(a) if a.what == "speed" else compare(a)


if __name__ == "__main__":
    main()
