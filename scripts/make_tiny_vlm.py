"""Build backstream/assets/vlm/: the tiny Qwen2-VL + processor that a run on the `shapes` task uses.

    python scripts/make_tiny_vlm.py            # a few minutes on one CPU thread (see below)

What it does, deterministically from --seed (same machine, same torch: same bytes):
1. processor and config from `backstream.tiny_vlm` (`build_processor`, `vlm_config`), the model from
   random init;
2. supervised next-token training on rows of `backstream.rl.data.shapes` drawn from a stream of its
   own, each rendered by the processor as the sampler renders it (chat template, the image expanded
   into its placeholders) followed by the answer and `<eos>`; the loss is the model's own (`labels`),
   on the answer digit and `<eos>` only;
3. every --eval-every steps, sample the held-out rows (`make_dataset("shapes", 1024, seed=10_000)`)
   at temperature 1 and stop once --target of them are right; save the model (float32, safetensors),
   the processor's parts and a generation config.

Why stop on the sampled accuracy, with no label smoothing (scripts/make_default_model.py smooths its
digits): counting is learnt gradually, and halfway the model's distribution over the five counts is
already peaked on the right one where the picture is easy (one or two shapes) and spread where it is
not; RL then has both kinds of prompts to learn from. The format ("digit<eos>") is learnt in the
first few dozen steps.

The shipped folder: `python scripts/make_tiny_vlm.py --max-steps 1500 --eval-every 500 --target 0.55 --threads 2`
(it did not reach the 0.55 target before step 1500): on 1024 other held-out rows (seed 20_000),
greedy 0.576, sampled at temperature 1 0.488, format 1.000; 792 s on the 2-core machine beside other
jobs (2 threads; the bytes depend on the thread count and the CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from backstream.rl.data.shapes import shapes_row
from backstream.rl.data.tasks import make_dataset
from backstream.tiny_vlm import TINY_VLM_DIR, VISION_TOKENS, build_processor, save_tiny_vlm, vlm_config


def encode(processor, rows: list[dict], answers: bool) -> dict:
    """The rows as the model's inputs: prompts rendered by the processor, with (`answers`) each row's
    answer and `<eos>` after it and `labels` on those tokens only. Right-padded; `lengths` [B]."""
    tok = processor.tokenizer
    texts = [processor.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    if answers:
        texts = [t + r["answer"] + tok.eos_token for t, r in zip(texts, rows)]
    batch = processor(text=texts, images=[r["images"][0] for r in rows], padding=True, padding_side="right",
                      return_tensors="pt")
    lengths = batch["attention_mask"].sum(1)
    if answers:
        labels = torch.full_like(batch["input_ids"], -100)
        for i, r in enumerate(rows):
            n = len(tok(r["answer"])["input_ids"]) + 1  # the answer's tokens and <eos>
            labels[i, lengths[i] - n : lengths[i]] = batch["input_ids"][i, lengths[i] - n : lengths[i]]
        batch["labels"] = labels
    return {**batch, "lengths": lengths}


@torch.no_grad()
def answer(model, processor, rows: list[dict], greedy: bool, seed: int = 0, batch_size: int = 256) -> dict:
    """Two tokens sampled after each prompt (at temperature 1, no top-k/top-p, or greedily), the
    model's plain forward without a cache: accuracy (the right digit, then `<eos>`), format rate (a
    digit, then `<eos>`) and the answers."""
    tok = processor.tokenizer
    digits = {tok.convert_tokens_to_ids(d): d for d in "0123456789"}
    vision_ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    texts = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        # one prompt length per forward: the colour names differ in length, and with no padding
        # the sampled token simply goes at the end
        by_len: dict[int, list[int]] = {}
        encoded = [encode(processor, [r], answers=False) for r in part]
        for i, e in enumerate(encoded):
            by_len.setdefault(int(e["lengths"][0]), []).append(i)
        out = [""] * len(part)
        for idx in by_len.values():
            ids = torch.cat([encoded[i]["input_ids"] for i in idx])
            vision = {"pixel_values": torch.cat([encoded[i]["pixel_values"] for i in idx]),
                      "image_grid_thw": torch.cat([encoded[i]["image_grid_thw"] for i in idx])}
            types = torch.cat([encoded[i]["mm_token_type_ids"] for i in idx])
            new = []
            for _ in range(2):
                logits = model(input_ids=ids, mm_token_type_ids=types, **vision).logits[:, -1].float()
                # a sampled <|image_pad|> would be read as a placeholder by the plain forward (the
                # sampler of a run treats it as a token): the vision ids are never an answer anyway
                logits[:, list(vision_ids)] = float("-inf")
                nxt = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
                new.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                types = torch.cat([types, torch.zeros_like(nxt)[:, None]], 1)
            for j, i in enumerate(idx):
                out[i] = (digits.get(int(new[0][j]), "?") if int(new[1][j]) == tok.eos_token_id else "?")
        texts += out
    model.train(was_training)
    acc = sum(t == r["answer"] for t, r in zip(texts, rows)) / len(rows)
    return {"acc": acc, "format": sum(t != "?" for t in texts) / len(rows), "answers": texts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=TINY_VLM_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--target", type=float, default=0.45, help="stop at this held-out accuracy at temperature 1")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    processor = build_processor()
    torch.manual_seed(args.seed)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(vlm_config(), dtype=torch.float32)
    model.train()
    print(f"{type(model).__name__}: {sum(x.numel() for x in model.parameters()) / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(f"make_tiny_vlm:{args.seed}")  # a stream of its own: no held-out row
    held_out = make_dataset("shapes", 1024, seed=10_000 + args.seed)

    t0, step = time.time(), 0
    while step < args.max_steps:
        step += 1
        batch = encode(processor, [shapes_row(rng) for _ in range(args.batch)], answers=True)
        batch.pop("lengths")
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            greedy = answer(model, processor, held_out, greedy=True)
            sampled = answer(model, processor, held_out, greedy=False)
            print(f"step {step:4d}  loss {loss.item():.3f}  held-out greedy {greedy['acc']:.3f} "
                  f"sampled {sampled['acc']:.3f} format {sampled['format']:.3f}  {time.time() - t0:.0f}s", flush=True)
            if sampled["acc"] >= args.target:
                break

    report = {"steps": step, "seconds": round(time.time() - t0)}
    rows = make_dataset("shapes", 1024, seed=20_000 + args.seed)
    for mode in ("greedy", "sampled"):
        r = answer(model, processor, rows, greedy=mode == "greedy")
        report[mode] = {"acc": round(r["acc"], 3), "format": round(r["format"], 3)}
    counts = [r["answer"] for r in rows]
    report["most_common_count"] = round(max(map(counts.count, set(counts))) / len(rows), 3)
    print(json.dumps(report, indent=1))

    save_tiny_vlm(model, processor, args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out}: {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
