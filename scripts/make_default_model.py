"""Build backstream/assets/default/: the tiny Qwen3 + character tokenizer that `backstream demo` uses.

    python scripts/make_default_model.py            # ~7 min on one CPU thread (see below)

What it does, deterministically from --seed (same machine, same torch: same bytes):
1. tokenizer and config from `backstream.default_model` (`build_tokenizer`, `default_config`);
2. supervised training from random init on the generated tasks of `backstream.rl.data.tasks`, each step
   - one batch of `arith`, and every 4th step one small batch of `kvlookup` (with 1 to 120 key=value
     pairs, mostly short ones, so it stays cheap while still reaching the ~1.1K positions of the real
     kvlookup prompts); the loss is on the answer tokens and the final `<eos>` only;
   - one batch of `toolcalc` episodes, as the episode sampler plays them in the plain format
     (`tasks.toolcalc_episode`): --tool-share of them call the tool (`[add a b]<eos>`, its result
     inserted, `[add a+b c]<eos>`, its result, the answer) and the others answer at once; the loss is
     on the model's turns only, `<eos>` included, never on the prompt or the inserted tool results.
     toolcalc draws from a random stream of its own, so the arith and kvlookup batches are those the
     script drew before toolcalc joined;
3. stop as soon as greedy decoding gets `--target` of held-out arith prompts right and
   `--tool-target` of held-out toolcalc episodes whose first turn is forced to start with "[" (the
   tool path; checked every --eval-every steps), and save model (float32, safetensors), tokenizer
   and generation config.

Why the answer digits are trained with label smoothing over the ten digits (--smoothing 0.5): the
model is meant to be right only part of the time at temperature 1, while answering in the right
format every time. Smoothing the target of each answer digit (1-ε on the right digit, ε spread over
all ten) teaches it the right answer as the mode but keeps a wrong digit likely when sampling, while
the `<eos>` target and the other characters stay exact, so the format does not degrade. The gap
between greedy decoding and sampling at temperature 1 is what GRPO with an exact-match reward
closes, fast (scripts/check_learnable.py). With --smoothing 0 and a target of ~0.35 instead, the
model is simply under-trained; RL then has to teach the arithmetic itself and needed ~150 steps of
32 x 8 samples for the same +0.3 in our runs: fine for a test, too slow for a CPU demo.

toolcalc is smoothed the same way, with two strengths: a direct answer's digits by --smoothing (0.5,
as arith, on a harder sum of three numbers), the digits of an episode that calls the tool (the call
arguments, the answer copied from the last result) by --tool-smoothing (0.1), since there the model
has only to copy numbers. So the tool path is right far more often than a direct answer, which is
what makes the tool worth calling, yet both are imperfect at temperature 1. Whether the first turn
is a call ("[") or a digit is learnt as the share of the data (--tool-share 0.4). GRPO then raises
the reward and the calls per episode together (`backstream demo --task toolcalc`).

At the stopping point (seed 0: step 1500; held-out rows): arith greedy 0.97, sampled at
temperature 1 0.21; toolcalc at temperature 1: the tool in 37% of the episodes, right 24% of the
time with it and 3% without (reward 0.11); greedy on the tool path 0.89, greedy answering at once
0.03. Greedy decoding picks "[" (one token with ~0.4 of the mass) over any single first digit in
half of the episodes.

Time (2-core shared machine, 1 thread): 7 to 9 minutes, ~0.3 s per step, 1500 steps. (The arith
and kvlookup training alone, as it was before toolcalc joined, stops at step 1800 with seed 0: when
the arithmetic clicks depends on the whole run, not on the arith batches alone.)
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

from backstream.default_model import DEFAULT_MODEL_DIR, build_tokenizer, default_config
from backstream.rl.agent.env import EnvConfig, Environment
from backstream.rl.agent.turns import PlainFormat
from backstream.rl.data.tasks import (
    KV_PAIRS,
    TASKS,
    arith_row,
    kvlookup_row,
    make_dataset,
    score,
    toolcalc_episode,
    toolcalc_row,
)


def encode_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, L] (right-padded) and targets [B, L] (-100 except answer tokens and <eos>)."""
    seqs, targets = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    return right_padded(tokenizer, seqs, targets)


def right_padded(tokenizer, seqs: list[list[int]], targets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as input_ids [B, L] padded with the pad id on the right, and their per-token
    targets [B, L] padded with -100."""
    length = max(map(len, seqs))
    ids_BL = torch.full((len(seqs), length), tokenizer.pad_token_id)
    targets_BL = torch.full((len(seqs), length), -100)
    for i, (seq, target) in enumerate(zip(seqs, targets)):
        ids_BL[i, : len(seq)] = torch.tensor(seq)
        targets_BL[i, : len(seq)] = torch.tensor(target)
    return ids_BL, targets_BL


def encode_episodes(tokenizer, rows: list[dict], use_tool: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """toolcalc episodes (`tasks.toolcalc_episode`, all calling the tool or none) as input_ids [B, L]
    (right-padded) and targets [B, L]: -100 except the model's turns, each with its <eos>; never the
    prompt or an inserted tool result. Batches of one kind: a direct answer (~13 tokens) padded to a
    tool episode's ~50 would triple its cost."""
    seqs, targets = [], []
    for row in rows:
        seq = tokenizer(row["prompt"])["input_ids"]
        target = [-100] * len(seq)
        for text, sampled in toolcalc_episode(row, use_tool):
            part = tokenizer(text)["input_ids"]  # "<eos>" is matched whole: the eos id
            seq += part
            target += part if sampled else [-100] * len(part)
        seqs.append(seq)
        targets.append(target)
    return right_padded(tokenizer, seqs, targets)


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


@torch.no_grad()
def play_toolcalc(model, tokenizer, rows: list[dict], greedy: bool, seed: int = 0, first: str = "") -> dict:
    """toolcalc episodes of `rows` as the RL sampler plays them (rl/rollout/episodes.py), at temperature 1 with
    no top-k/top-p or greedily: turns of at most the task's `rollout.max_new_tokens` up to <eos>, read
    by the plain format (rl/agent/turns.py), calls run on the task's environment (rl/agent/env.py, the
    `Calculator`) and their results inserted, at most `env.max_turns` turns; the reward is the
    trainer's (`score` of the last message). `first` forces the start of the first turn ("[": the tool
    path). Returns the mean reward, the share of episodes whose first turn calls the tool, the reward
    of those (`acc_tool`) and of the others (`acc_direct`), and well-formed calls per episode."""
    defaults = TASKS["toolcalc"].defaults
    env = Environment.load(EnvConfig(factory=defaults["env.factory"]))
    fmt = PlainFormat(tokenizer, env.schemas)
    max_turns, max_new = defaults["env.max_turns"], defaults["rollout.max_new_tokens"]
    n, forced = len(rows), fmt.encode(first)
    ids = [fmt.prompt(r["prompt"], None)[0] for r in rows]  # the episode so far
    starts = [len(x) for x in ids]
    instances = [env.new(r, i)[0] for i, r in enumerate(rows)]
    messages: list[list[dict]] = [[] for _ in rows]
    first_call, good_calls, live = [False] * n, [0] * n, list(range(n))
    sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for turn in range(max_turns):
            if not live:
                break
            head = forced if turn == 0 else []
            context = [ids[i] + head for i in live]
            length = max(map(len, context))
            batch = torch.tensor([[tokenizer.pad_token_id] * (length - len(c)) + c for c in context])
            mask = torch.tensor([[0] * (length - len(c)) + [1] * len(c) for c in context])
            out = model.generate(
                input_ids=batch, attention_mask=mask, do_sample=not greedy, **sampling,
                max_new_tokens=max_new - len(head), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[:, length:].tolist()
            still = []
            for i, new in zip(live, out):
                sampled = head + new
                if tokenizer.eos_token_id in sampled:
                    sampled = sampled[: sampled.index(tokenizer.eos_token_id) + 1]
                ids[i] += sampled
                message, calls = fmt.parse(sampled)
                messages[i].append(message)
                first_call[i] |= turn == 0 and bool(calls)
                if tokenizer.eos_token_id not in sampled or not calls:
                    continue  # an answer, or a turn cut at max_new: the episode is over
                results = []
                for call in calls:
                    content, failed = env.call(instances[i], call)[:2]
                    good_calls[i] += not failed
                    results.append((call.name, content))
                    messages[i].append({"role": "tool", "name": call.name, "content": content})
                ids[i] += fmt.tool_results(results)
                still.append(i)
            live = still
    for instance in instances:  # each lives in a worker process: back to the pool
        instance.release()
    model.train()
    reward = [score(m[-1].get("content", ""), r["answer"]) for m, r in zip(messages, rows)]
    tool = [x for x, c in zip(reward, first_call) if c]
    direct = [x for x, c in zip(reward, first_call) if not c]
    return {
        "reward": sum(reward) / n, "tool_share": len(tool) / n,
        "acc_tool": sum(tool) / max(1, len(tool)), "acc_direct": sum(direct) / max(1, len(direct)),
        "good_calls": sum(good_calls) / n,
        "examples": [tokenizer.decode(ids[i][starts[i]:]) for i in range(min(n, 4))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--arith-batch", type=int, default=128)
    p.add_argument("--kv-batch", type=int, default=4)
    p.add_argument("--kv-every", type=int, default=4, help="a kvlookup batch every this many steps")
    p.add_argument("--tc-batch", type=int, default=16, help="toolcalc episodes per step")
    p.add_argument("--tool-share", type=float, default=0.4, help="share of toolcalc episodes that call the tool")
    p.add_argument("--smoothing", type=float, default=0.5, help="label smoothing of answer digits")
    p.add_argument("--tool-smoothing", type=float, default=0.1,
                   help="label smoothing of the digits of toolcalc episodes that call the tool")
    p.add_argument("--target", type=float, default=0.85, help="stop at this greedy arith accuracy ...")
    p.add_argument("--tool-target", type=float, default=0.8,
                   help="... and this greedy toolcalc accuracy on the tool path")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=4000)
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
    tc_rng = random.Random(f"toolcalc:{args.seed}")  # its own stream: the arith and kvlookup data as before
    held_out = make_dataset("arith", 256, seed=10_000 + args.seed)
    held_out_tc = make_dataset("toolcalc", 128, seed=10_000 + args.seed)

    t0, step, loss_kv = time.time(), 0, torch.tensor(float("nan"))
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
        # toolcalc: a --tool-share of the episodes call the tool, the others answer at once; the
        # loss is the mean over the model's tokens of both kinds (each kind is its own batch)
        tc_rows = [toolcalc_row(tc_rng) for _ in range(args.tc_batch)]
        use_tool = [tc_rng.random() < args.tool_share for _ in tc_rows]
        parts = []
        for kind, eps in ((True, args.tool_smoothing), (False, args.smoothing)):
            rows = [r for r, u in zip(tc_rows, use_tool) if u == kind]
            if rows:
                ids_BL, targets_BL = encode_episodes(tokenizer, rows, kind)
                parts.append((sft_loss(model, ids_BL, targets_BL, digit_ids, eps), (targets_BL != -100).sum()))
        loss_tc = sum(part * n for part, n in parts) / sum(n for _, n in parts)
        loss = loss + loss_tc
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            greedy = evaluate(model, tokenizer, held_out, greedy=True)
            sampled = evaluate(model, tokenizer, held_out, greedy=False)
            tool_path = play_toolcalc(model, tokenizer, held_out_tc, greedy=True, first="[")
            tc = play_toolcalc(model, tokenizer, held_out_tc, greedy=False)
            print(
                f"step {step:4d}  loss arith {loss_arith.item():.3f} kv {loss_kv.item():.3f} "
                f"toolcalc {loss_tc.item():.3f}  arith greedy {greedy['acc']:.3f} sampled {sampled['acc']:.3f} "
                f"format {sampled['format']:.3f}  toolcalc greedy tool path {tool_path['reward']:.3f}, "
                f"T=1: reward {tc['reward']:.3f} tool {tc['tool_share']:.2f} (right {tc['acc_tool']:.3f}) "
                f"direct right {tc['acc_direct']:.3f}  {time.time() - t0:.0f}s",
                flush=True,
            )
            if greedy["acc"] >= args.target and tool_path["reward"] >= args.tool_target:
                break

    report = {"steps": step, "seconds": round(time.time() - t0)}
    for task, n in (("arith", 256), ("kvlookup", 32)):
        rows = make_dataset(task, n, seed=20_000 + args.seed)
        for mode in ("greedy", "sampled"):
            r = evaluate(model, tokenizer, rows, greedy=mode == "greedy")
            report[f"{task}_{mode}"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
    rows = make_dataset("toolcalc", 256, seed=20_000 + args.seed)
    for mode, greedy, first in (("greedy", True, ""), ("tool_path_greedy", True, "["), ("sampled", False, "")):
        r = play_toolcalc(model, tokenizer, rows, greedy=greedy, first=first)
        report[f"toolcalc_{mode}"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
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
