"""Build backstream/assets/default/: the tiny Qwen3 + character tokenizer that `backstream demo` uses.

    python scripts/make_default_model.py            # ~6 min on one CPU thread (see below)

What it does, deterministically from --seed (same machine, same torch: same bytes):
1. tokenizer and config from `backstream.default_model` (`build_tokenizer`, `default_config`);
2. supervised training from random init on the generated tasks of `backstream.rl.tasks`, each step one
   batch of `arith` and one small batch of `kvlookup` (with 1 to 120 key=value pairs, mostly short
   ones, so it stays cheap while still reaching the ~1.1K positions of the real kvlookup prompts);
   the loss is on the answer tokens and the final `<eos>` only;
3. stop as soon as greedy decoding gets `--target` of held-out arith prompts right (checked every
   --eval-every steps), and save model (float32, safetensors), tokenizer and generation config.

Why the answer digits are trained with label smoothing over the ten digits (--smoothing 0.5): the
model is meant to be right only part of the time at temperature 1, while answering in the right
format every time. Smoothing the target of each answer digit (1-ε on the right digit, ε spread over
all ten) teaches it the right answer as the mode but keeps a wrong digit likely when sampling, while
the `<eos>` target and the other characters stay exact, so the format does not degrade. At the
stopping point greedy decoding is right ~85-90% of the time and sampling at temperature 1 ~20%:
the gap is what GRPO with an exact-match reward closes, fast (scripts/check_learnable.py: +0.3 mean
reward in ~40 steps of 16 prompts x 8 samples). With --smoothing 0 and a target of ~0.35 instead,
the model is simply under-trained; RL then has to teach the arithmetic itself and needed ~150 steps
of 32 x 8 samples for the same +0.3 in our runs: fine for a test, too slow for a CPU demo.

Time (2-core shared machine, 1 thread): about 6 minutes, ~0.5 s per step, ~600 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from backstream.default_model import DEFAULT_MODEL_DIR, build_tokenizer, default_config  # noqa: E402
from backstream.rl.tasks import KV_PAIRS, arith_row, kvlookup_row, make_dataset, score  # noqa: E402


def encode_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, L] (right-padded) and targets [B, L] (-100 except answer tokens and <eos>)."""
    seqs, starts = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    length = max(map(len, seqs))
    ids_BL = torch.full((len(seqs), length), tokenizer.pad_token_id)
    targets_BL = torch.full((len(seqs), length), -100)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids_BL[i, : len(seq)] = torch.tensor(seq)
        targets_BL[i, start : len(seq)] = torch.tensor(seq[start:])
    return ids_BL, targets_BL


def sft_loss(model, ids_BL, targets_BL, digit_ids: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Mean over target tokens of cross-entropy, with digit targets smoothed over the 10 digits."""
    logp_BLV = model(input_ids=ids_BL).logits[:, :-1].float().log_softmax(-1)
    targets = targets_BL[:, 1:]
    valid = targets != -100
    hard = -logp_BLV.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    is_digit = torch.isin(targets, digit_ids)
    uniform = -logp_BLV[..., digit_ids].mean(-1)
    per_token = torch.where(is_digit, (1 - smoothing) * hard + smoothing * uniform, hard)
    return (per_token * valid).sum() / valid.sum()


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], greedy: bool, seed: int = 0) -> dict:
    """Accuracy (tasks.score) and format rate (digits then <eos>) of `rows`, sampling at
    temperature 1 with no top-k/top-p, or greedy. Prompts of a batch must have equal lengths."""
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ids = torch.tensor([tokenizer(r["prompt"])["input_ids"] for r in rows])
        sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=not greedy, **sampling,
            max_new_tokens=6, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
    model.train()
    comp = out[:, ids.shape[1] :].tolist()
    well_formed = 0
    for c in comp:
        body = c[: c.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in c else None
        well_formed += body is not None and len(body) > 0 and tokenizer.decode(body).isdigit()
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    acc = sum(score(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)
    return {"acc": acc, "format": well_formed / len(rows), "examples": texts[:6]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--arith-batch", type=int, default=128)
    p.add_argument("--kv-batch", type=int, default=4)
    p.add_argument("--kv-every", type=int, default=4, help="a kvlookup batch every this many steps")
    p.add_argument("--smoothing", type=float, default=0.5, help="label smoothing of answer digits")
    p.add_argument("--target", type=float, default=0.85, help="stop at this greedy arith accuracy")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_tokenizer()
    config = default_config(len(tokenizer))
    torch.manual_seed(args.seed)
    from transformers import GenerationConfig, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(config).float()
    model.train()
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = random.Random(args.seed)
    held_out = make_dataset("arith", 256, seed=10_000 + args.seed)

    t0, step = time.time(), 0
    while step < args.max_steps:
        step += 1
        arith = encode_batch(tokenizer, [arith_row(rng) for _ in range(args.arith_batch)])
        # log-uniform number of pairs: mostly short (cheap), sometimes the full ~1.1K tokens, so
        # that RoPE positions up to the real prompt length are seen; one length per batch: no pad
        loss_arith = sft_loss(model, *arith, digit_ids, args.smoothing)
        loss = loss_arith
        if step % args.kv_every == 0:
            n_pairs = min(KV_PAIRS, int(math.exp(rng.uniform(0.0, math.log(KV_PAIRS + 1)))))
            kv = encode_batch(tokenizer, [kvlookup_row(rng, n_pairs) for _ in range(args.kv_batch)])
            loss_kv = sft_loss(model, *kv, digit_ids, args.smoothing)
            loss = loss + loss_kv
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            greedy = evaluate(model, tokenizer, held_out, greedy=True)
            sampled = evaluate(model, tokenizer, held_out, greedy=False)
            print(
                f"step {step:4d}  loss arith {loss_arith.item():.3f} kv {loss_kv.item():.3f}  "
                f"arith greedy {greedy['acc']:.3f} sampled {sampled['acc']:.3f} "
                f"format {sampled['format']:.3f}  {time.time() - t0:.0f}s",
                flush=True,
            )
            if greedy["acc"] >= args.target:
                break

    report = {"steps": step, "seconds": round(time.time() - t0)}
    for task, n in (("arith", 256), ("kvlookup", 32)):
        rows = make_dataset(task, n, seed=20_000 + args.seed)
        for mode in ("greedy", "sampled"):
            r = evaluate(model, tokenizer, rows, greedy=mode == "greedy")
            report[f"{task}_{mode}"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
    print(json.dumps(report, indent=1))

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        # like RL rollouts, generate() samples, and "temperature 1" means the model's own
        # distribution: without top_k=0 transformers applies a top-k of 50
        do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out}: {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
