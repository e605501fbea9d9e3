"""Does RL visibly work on the shipped default model? A plain-PyTorch GRPO loop that says so.

    python scripts/check_learnable.py                 # arith, 60 steps, ~30 s on one CPU thread

It depends only on `backstream.rl.data.tasks` and `backstream.default_model`, not on the engine, so that
"the default model can learn" is checked apart from "backstream computes the right gradient". It plays
single-turn tasks (arith, kvlookup); the multi-turn toolcalc is refused (`backstream demo --task
toolcalc` plays its episodes). Each
step: P prompts, G samples each at temperature 1 with `model.generate` (no top-k/top-p), the
exact-match reward (`tasks.score`), group-normalised advantages A = (r - mean_g) / (std_g + 1e-4),
and one AdamW step on

    loss = - Σ_i Σ_t A_i · log πθ(y_i,t | x_i, y_i,<t) / Σ_i |y_i|

over the completion tokens (up to and including <eos>). What it leaves out, on purpose: one
gradient step per batch of fresh samples, so the PPO ratio is 1 and its clipping never acts; no KL
or reference model; no engine, tree or prefix sharing.

It prints the mean reward per step, the held-out accuracy at temperature 1 before and after, and
exits non-zero if the mean reward of the last --window steps is not --min-rise above that of the
first --window steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from backstream.default_model import load_default
from backstream.rl.data.tasks import get_task, make_dataset, score


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float):
    """Left-padded prompts [N, Lp] and their completions [N, Lc] (pad after <eos>)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    model.eval()
    out = model.generate(
        **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.train()
    return enc["input_ids"], enc["attention_mask"], out[:, enc["input_ids"].shape[1] :]


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids) -> torch.Tensor:
    """log πθ of each completion token [N, Lc]. Positions count real tokens only, so a left-padded
    row sees the positions it had when sampled (RoPE would otherwise shift by the padding)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits_NLV = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    # the logits at position t predict token t+1: those from the last prompt token on
    logits_NCV = logits_NLV[:, prompt_ids.shape[1] - 1 : -1].float()
    return logits_NCV.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]


@torch.no_grad()
def heldout_accuracy(model, tokenizer, rows, max_new_tokens, temperature) -> float:
    _, _, comp = sample(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, temperature)
    texts = tokenizer.batch_decode(comp, skip_special_tokens=True)
    return sum(score(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="arith")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16, help="P: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    p.add_argument("--min-rise", type=float, default=0.3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    task = get_task(args.task)
    if "env.factory" in task.defaults:  # its completions are episodes: turns, tool calls, inserted results
        p.error(f"--task {task.name} is multi-turn, which this single-turn loop does not play; check it with "
                f"`backstream demo --task {task.name}` (the episode sampler)")
    max_new = args.max_new_tokens or task.max_new_tokens
    model, tokenizer = load_default(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = make_dataset(task, args.prompts * args.steps, seed=args.seed)
    heldout = make_dataset(task, 256 if task.name == "arith" else 32, seed=10_000 + args.seed)
    P, G = args.prompts, args.group

    before = heldout_accuracy(model, tokenizer, heldout, max_new, args.temperature)
    print(f"held-out accuracy at T={args.temperature} before: {before:.3f}", flush=True)
    rewards, t0 = [], time.time()
    for step in range(args.steps):
        rows = data[step * P : (step + 1) * P]
        prompts = [r["prompt"] for r in rows for _ in range(G)]
        prompt_ids, prompt_mask, comp = sample(model, tokenizer, prompts, max_new, args.temperature)
        texts = tokenizer.batch_decode(comp, skip_special_tokens=True)
        r_N = torch.tensor([score(t, rows[i // G]["answer"]) for i, t in enumerate(texts)])
        r_PG = r_N.view(P, G)
        adv_N = ((r_PG - r_PG.mean(1, keepdim=True)) / (r_PG.std(1, keepdim=True) + 1e-4)).view(-1)

        # completion tokens up to and including the first <eos>; generate pads after it
        is_eos = comp == tokenizer.eos_token_id
        loss_mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).float()
        logp_NC = completion_logprobs(model, prompt_ids, prompt_mask, comp)
        loss = -(adv_N[:, None] * logp_NC * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        rewards.append(r_N.mean().item())
        print(
            f"step {step:3d}  reward {rewards[-1]:.3f}  "
            f"groups with signal {(r_PG.std(1) > 0).float().mean():.2f}  "
            f"completion tokens {loss_mask.sum(1).mean():.2f}  {time.time() - t0:.0f}s",
            flush=True,
        )

    after = heldout_accuracy(model, tokenizer, heldout, max_new, args.temperature)
    w = min(args.window, len(rewards) // 2)
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    print(f"held-out accuracy at T={args.temperature} after: {after:.3f} (before {before:.3f})")
    print(f"mean reward, first {w} steps {first:.3f} -> last {w} steps {last:.3f}: rise {last - first:+.3f}")
    if last - first < args.min_rise:
        print(f"FAIL: rise below {args.min_rise}")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
