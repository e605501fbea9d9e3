"""backstream against TRL's GRPOTrainer on a vision-language model (issue 53, "Against TRL"), back to back.

The model (`--family`): a tiny random composite, float32, built from a config (`vlm_config()`, no
download) and saved with its processor to a folder both sides load. The text part: hidden 384, 6
layers, GQA 6:2 of dimension 64, MLP 1024, M-RoPE sections 8/12/12 (the proportions of
bench/common.py's model). `qwen3_vl` (the default): `Qwen3VLForConditionalGeneration`, interleaved
M-RoPE, a vision tower of 3 blocks, width 128, 4 heads, 16-px patches, whose blocks 0 and 1 also give
deepstack features (added after decoder layers 0 and 1 at the image positions), the 2 × 2 merger
projecting to 384; `qwen2_vl`: `Qwen2VLForConditionalGeneration`, a tower of 2 blocks, width 128,
14-px patches. The tokenizer and chat template are the tiny VLM's (backstream/tiny_vlm.py: 103 ids,
so the LM head is cheap and the ratios are the decoder's and the tower's), its processor the family's
image-only processor (torchvision is absent on a CPU machine) whose size limits keep the bench's
picture as it is: an image of (2p·h) × (2p·w) pixels (p the patch size) is h·w visual tokens after
the merge.

The work, the same on both sides: one prompt, a noise picture of N visual tokens (N = 2048 and 512)
and a short question, G = 8 samples at temperature 1, at most 64 new tokens, rewarded by
`bench/rewards.py:text_hash` (different texts, different rewards: every group has advantages, so
both learners do all their work), GRPO advantages, the token-mean clipped objective (eps 0.2; TRL:
loss_type "dapo", scale_rewards "group", beta 0), AdamW at a constant 2e-5 (as bench_real), betas (0.9, 0.99), no
weight decay, gradient norm clipped at 1.0, 3 steps. The vision tower and its merger are frozen on
both sides (backstream: `model.freeze_vision`, its default; TRL trains every parameter that requires
a gradient, so the bench sets requires_grad False on the `visual` parameters before building the
trainer). TRL 1.16 in two float32 variants, both set explicitly (`GRPOConfig` defaults to bf16=True
and gradient_checkpointing=True): "trl" without gradient checkpointing, "trl-ckpt" with it.

Measured: seconds per step (the mean over the steps after the first, which pays one-off costs), the
peak resident set of the side's process (ru_maxrss, model loading included), the mean completion
length (the random model stops at <eos> by chance, so the two sides' work differs a little; it is
printed). Each side in a fresh process; the machine runs nothing else meanwhile.

    python -m bench.bench_vision [--family qwen3_vl] [--tokens 2048,512] [--steps 3] [--sides backstream,trl,trl-ckpt]
    python -m bench.bench_vision --smoke        # 128 visual tokens, 16 new tokens, 2 steps: 1-2 minutes
    python -m bench.bench_vision --many 8       # backstream: 8 pictures of 1000 visual tokens against 1, the peaks
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench import common

STEPS, G, NEW, LR, SEED = 3, 8, 64, 2e-5, 0
TOKENS = (2048, 512)
SMOKE = {"tokens": "128", "steps": 2, "new": 16}  # --smoke: every code path of both sides, in minutes
QUESTION = "What is in the picture?"
PHASES = ("time/rollout", "time/prefill", "time/backward", "time/optim")  # backstream's step, split
TRL_SIDES = {"trl": False, "trl-ckpt": True}  # TRL's variants, float32 both: gradient checkpointing off / on


FAMILIES = ("qwen3_vl", "qwen2_vl")
FAMILY = os.environ.get("BENCH_VISION_FAMILY", "qwen3_vl")  # main() sets it from --family; children inherit it
PATCH = {"qwen3_vl": 16, "qwen2_vl": 14}


def vlm_config(family: str | None = None):
    """The bench's composite (the module docstring): tiny_vlm.vlm_config()'s vocabulary and special
    ids at bench/common.py's width (hidden 384, 6 layers, 6 query / 2 K/V heads of 64, MLP 1024)."""
    from transformers import AutoConfig

    from backstream.tiny_vlm import vlm_config as tiny

    family = family or FAMILY
    base = tiny()
    text = base.text_config
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    if family == "qwen3_vl":
        rope["mrope_interleaved"] = True
        vision = dict(depth=3, hidden_size=128, intermediate_size=512, num_heads=4, out_hidden_size=384,
                      in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=1024, deepstack_visual_indexes=[0, 1])
    else:
        vision = dict(depth=2, embed_dim=128, num_heads=4, mlp_ratio=4, hidden_size=384, in_channels=3,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return AutoConfig.for_model(
        family,
        text_config=dict(
            vocab_size=text.vocab_size, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, head_dim=64, intermediate_size=1024, max_position_embeddings=8192,
            rope_parameters=rope, tie_word_embeddings=True,
            pad_token_id=text.pad_token_id, bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
        ),
        vision_config=vision, vision_start_token_id=base.vision_start_token_id, image_token_id=base.image_token_id,
        video_token_id=base.video_token_id, vision_end_token_id=base.vision_end_token_id, tie_word_embeddings=True,
    )


def build_processor(max_tokens: int, family: str | None = None):
    """The tiny VLM's image-only processor of the family, with size limits that keep a picture of up to
    `max_tokens` visual tokens (2p px a side each, after the 2 × 2 merge) at its own size."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from backstream.tiny_vlm import CHAT_TEMPLATE, build_tokenizer_vlm, images_only

    family = family or FAMILY
    side = 2 * PATCH[family]
    size = {"shortest_edge": side * side, "longest_edge": side * side * max_tokens}
    image_processor = Qwen2VLImageProcessorPil(size=size, patch_size=PATCH[family], merge_size=2)  # the bench's tower
    cls = transformers.Qwen3VLProcessor if family == "qwen3_vl" else transformers.Qwen2VLProcessor
    return images_only(cls)(image_processor=image_processor, tokenizer=build_tokenizer_vlm(),
                            video_processor=None, chat_template=CHAT_TEMPLATE)


def model_dir(out: str, max_tokens: int) -> str:
    """The random model and its processor, saved to `out/model` (seeded: both sides load the same weights)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from backstream.tiny_vlm import save_tiny_vlm

    folder = os.path.join(out, "model")
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(vlm_config(), dtype=torch.float32)
    save_tiny_vlm(model, build_processor(max_tokens), folder)
    return folder


def grid(n: int) -> tuple[int, int]:
    """(h, w) merged-token rows and columns with h·w = n, as square as n allows (h ≤ w)."""
    h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return h, n // h


def picture(n: int, k: int = 0):
    """Seeded RGB noise of (2p·h) × (2p·w) pixels (p: the family's patch): n visual tokens, nothing for
    the processor to resize (the k-th of a prompt's pictures: each its own noise)."""
    import numpy as np
    from PIL import Image

    h, w = grid(n)
    side = 2 * PATCH[FAMILY]
    gen = np.random.default_rng(SEED if k == 0 else [SEED, k])
    pixels = gen.integers(0, 256, size=(side * h, side * w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt(images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": QUESTION}]}]


def prompt_tokens(folder: str, n: int) -> tuple[int, int]:
    """(visual tokens, prompt tokens) of the prompt with the bench's picture, as the folder's processor
    gives them through `backstream.rl.policy.load_processor` (the loader backstream's run uses)."""
    from backstream.rl.policy import load_processor

    proc = load_processor(folder)
    text = proc.apply_chat_template(prompt(), add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[picture(n)], return_tensors="pt")
    ids = enc["input_ids"][0]
    return int((ids == vlm_config().image_token_id).sum()), len(ids)


def side_backstream(steps: int, out: str, n: int, new: int, images: int = 1) -> dict:
    from backstream import config, trainer

    folder = model_dir(out, n)
    names = [f"picture{k}.png" for k in range(images)]
    for k, name in enumerate(names):
        picture(n, k).save(os.path.join(out, name))
    data = os.path.join(out, "vision.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"prompt": prompt(images), "images": names}) + "\n")
    cfg = config.load(None, [f'model.name="{folder}"', "model.freeze_vision=true", f'data.path="{data}"',
                             "reward.functions=['bench/rewards.py:text_hash']", f"train.steps={steps}",
                             "train.prompts_per_step=1", f"rollout.group_size={G}", f"rollout.max_new_tokens={new}",
                             f"data.max_prompt_tokens={images * n + 256}", "train.save_every_minutes=0",
                             f"optim.lr={LR}",
                             "optim.betas=[0.9, 0.99]", f"train.seed={SEED}", "train.progress=false",
                             "train.plots=false", f'train.output_dir="{os.path.join(out, "run")}"'])
    run = trainer.train(cfg)
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    return {"step_s": [x["time/step"] for x in lines], "reward": [x["reward/mean"] for x in lines],
            "completion_len": [x["response_length/mean"] for x in lines],
            "image_tokens": [x.get("vision/image_tokens") for x in lines],
            "encoder_calls": [x.get("vision/encoder_calls") for x in lines],
            "phases_s": [{k[5:]: round(x[k], 2) for k in PHASES if x.get(k)} for x in lines]}


def side_trl(steps: int, out: str, n: int, new: int, checkpointing: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from backstream.rl.policy import load_processor
    from bench.rewards import text_hash

    folder = model_dir(out, n)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    frozen = [p for name, p in model.named_parameters() if ".visual." in f".{name}"]  # the tower and its merger
    assert frozen, "no vision parameters found to freeze"
    for p in frozen:
        p.requires_grad_(False)
    proc = load_processor(folder)  # the same image-only processor as backstream's (no torchvision here)
    ds = Dataset.from_list([{"prompt": prompt(), "image": picture(n)}] * steps)
    args = GRPOConfig(output_dir=os.path.join(out, "trl"), per_device_train_batch_size=G, num_generations=G,
                      max_completion_length=new, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                      weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
                      loss_type="dapo", scale_rewards="group", temperature=1.0, max_steps=steps, logging_steps=1,
                      save_strategy="no", report_to="none", use_cpu=True, use_vllm=False, seed=SEED,
                      shuffle_dataset=False, gradient_accumulation_steps=1, bf16=False, fp16=False,
                      gradient_checkpointing=checkpointing)
    times, rewards, lengths, last = [], [], [], [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                lengths.append(logs.get("completions/mean_length"))

    trainer = GRPOTrainer(model=model, reward_funcs=[text_hash], args=args, train_dataset=ds, processing_class=proc,
                          callbacks=[Clock()])
    last[0] = time.perf_counter()
    trainer.train()
    return {"step_s": times, "reward": rewards, "completion_len": lengths,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def child(side: str, steps: int, n: int, new: int, images: int = 1) -> None:
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as out:
        if side == "backstream":
            res = side_backstream(steps, out, n, new, images)
        else:
            res = side_trl(steps, out, n, new, TRL_SIDES[side])
    res["peak_rss_MiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps(res), flush=True)


def run_side(side: str, steps: int, n: int, new: int, images: int = 1) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.bench_vision", "--child", side, "--steps", str(steps),
                           "--tokens", str(n), "--new", str(new), "--images", str(images)],
                          capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        if proc.returncode == -9 or "MemoryError" in proc.stderr or "out of memory" in proc.stderr.lower():
            print(json.dumps({"side": side, "visual_tokens": n, "oom": True}), flush=True)
            return {"oom": True, "returncode": proc.returncode}
        raise RuntimeError(f"{side} failed: {proc.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["wall_s"] = round(time.perf_counter() - t, 1)
    later = res["step_s"][1:] or res["step_s"]
    res["s_per_step"] = round(sum(later) / len(later), 2)
    lens = [x for x in res.get("completion_len", []) if x is not None]
    res["mean_completion_len"] = round(sum(lens) / len(lens), 1) if lens else None
    if res.get("phases_s"):  # backstream: where its step went, the same steps as s_per_step
        split = res["phases_s"][1:] or res["phases_s"]
        res["phases_per_step"] = {k: round(sum(x.get(k, 0) for x in split) / len(split), 2) for k in split[0]}
    print(json.dumps({"side": side, "visual_tokens": n, **{k: res.get(k) for k in (
        "s_per_step", "peak_rss_MiB", "mean_completion_len", "wall_s", "phases_per_step") if k in res}}), flush=True)
    return res


MANY_TOKENS = 1000  # a picture's visual tokens in --many: 8 of them and the question fit 8192 positions


def many(k: int, n: int, steps: int, new: int) -> None:
    """backstream's peak and step time with one picture of n visual tokens in the prompt, and with k."""
    res = {"model": f"random {FAMILY} (bench_vision.vlm_config), float32", "G": G, "max_new_tokens": new,
           "steps": steps, "visual_tokens_per_picture": n, "points": {}}
    for images in (1, k):
        print(f"{images} picture(s) of {n} visual tokens: {images * n} visual tokens", flush=True)
        res["points"][images] = run_side("backstream", steps, n, new, images)
    one, all_ = res["points"][1], res["points"][k]
    res["peak_ratio"] = round(all_["peak_rss_MiB"] / one["peak_rss_MiB"], 3)
    print(f"{k} pictures against 1: peak {all_['peak_rss_MiB']} / {one['peak_rss_MiB']} MiB = {res['peak_ratio']} "
          f"(target <= 2), s/step {all_['s_per_step']} / {one['s_per_step']}")
    print("saved", common.save("vision_many" + ("" if FAMILY == "qwen3_vl" else f"_{FAMILY}"), res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=None, help="visual tokens of the picture, comma-separated (default 2048,512)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--new", type=int, default=None, help="most new tokens per sample (default 64)")
    ap.add_argument("--sides", default="backstream,trl,trl-ckpt")
    ap.add_argument("--smoke", action="store_true", help="128 visual tokens, 16 new tokens, 2 steps (1-2 minutes)")
    ap.add_argument("--many", type=int, default=0, metavar="K",
                    help="backstream only: one picture of --tokens (default 1000) visual tokens against K of them in "
                         "one prompt, the peak of each (issue 53's memory target: K = 8)")
    ap.add_argument("--family", choices=FAMILIES, default=None, help="the random composite (default qwen3_vl)")
    ap.add_argument("--images", type=int, default=1, help=argparse.SUPPRESS)  # a child's pictures per prompt
    ap.add_argument("--child")
    a = ap.parse_args()
    global FAMILY
    if a.family:
        FAMILY = os.environ["BENCH_VISION_FAMILY"] = a.family
    if a.many and not a.child:
        many(a.many, int(a.tokens or MANY_TOKENS), a.steps or STEPS, a.new or NEW)
        return
    tokens = a.tokens or (SMOKE["tokens"] if a.smoke else ",".join(map(str, TOKENS)))
    steps = a.steps or (SMOKE["steps"] if a.smoke else STEPS)
    new = a.new or (SMOKE["new"] if a.smoke else NEW)
    if a.child:
        child(a.child, steps, int(tokens), new, a.images)
        return
    sides_wanted = a.sides.split(",")
    res = {"model": f"random {FAMILY} (bench_vision.vlm_config), float32", "G": G, "max_new_tokens": new,
           "steps": steps, "lr": LR, "tower": "frozen on both sides",
           "trl": "float32 both (bf16=False); trl: gradient_checkpointing=False, trl-ckpt: True", "points": []}
    with tempfile.TemporaryDirectory() as out:
        folder = model_dir(out, max(int(x) for x in tokens.split(",")))
        counts = {int(x): prompt_tokens(folder, int(x)) for x in tokens.split(",")}
    for n in (int(x) for x in tokens.split(",")):
        visual, total = counts[n]
        h, w = grid(n)
        side = 2 * PATCH[FAMILY]
        print(f"picture {side * w} x {side * h} px: {visual} visual tokens, {total} prompt tokens", flush=True)
        point = {"visual_tokens": visual, "prompt_tokens": total, "sides": {}}
        for side in sides_wanted:
            point["sides"][side] = run_side(side, steps, n, new)
        sides = point["sides"]
        for trl in TRL_SIDES:
            if {"backstream", trl} <= set(sides) and not (sides["backstream"].get("oom") or sides[trl].get("oom")):
                point[f"speedup_vs_{trl}"] = round(sides[trl]["s_per_step"] / sides["backstream"]["s_per_step"], 2)
                point[f"peak_ratio_vs_{trl}"] = round(sides["backstream"]["peak_rss_MiB"] / sides[trl]["peak_rss_MiB"],
                                                      3)
        res["points"].append(point)
    table = [{"visual_tokens": p["visual_tokens"], "side": k, "s_per_step": v.get("s_per_step", "OOM"),
              "peak_rss_MiB": v.get("peak_rss_MiB", "OOM"), "mean_len": v.get("mean_completion_len")}
             for p in res["points"] for k, v in p["sides"].items()]
    print(common.table(table, list(table[0])))
    for p in res["points"]:  # the targets (issue 53): speed-up >= 4, peak ratio <= 0.25, against both TRL sides
        ratios = {k: v for k, v in p.items() if k.startswith(("speedup", "peak_ratio"))}
        print(p["visual_tokens"], "visual tokens:", ratios)
    tail = "" if FAMILY == "qwen3_vl" else f"_{FAMILY}"
    print("saved", common.save(("vision_smoke" if a.smoke else "vision") + tail, res))


if __name__ == "__main__":
    main()
