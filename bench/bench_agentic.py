"""Agentic episodes: one trainer step of the same multi-turn episodes in three layouts, side by side.

G = 8 episodes of one task share a system + tools prompt of ~1K tokens; each has 4 sampled turns of
~200 tokens with a ~300-token tool result between two turns (loss on the sampled turns only). The
layouts, each with the no-grad log-prob pass a PPO-style trainer runs before its backward:
  tree      backstream: the episodes on one token tree, stream_backward (its prefill is that pass;
            the shared prompt is forwarded and backpropagated once)
  rows      one row per episode (TRL's layout): a no-grad forward per episode, then one forward and
            backward per episode (reference_backward)
  per-turn  one sample per turn (verl's, slime's and AReaL's layout): turn k's sample holds the whole
            context up to it with the loss on turn k only; a no-grad forward and a forward+backward each
The three give the same gradient (tests/rl/agent/test_episodes.py checks it in float64); what differs is the
tokens forwarded and the time. Targets (issue 21): tree ≥ 3× faster than per-turn; against rows, a
speed-up ≥ 85% of the token ratio rows/tree (the bound for the linear layers, ≈ 1.4 for this shape).

The model is random with Qwen3-0.6B's shape per layer (hidden 1024, 16 query and 8 K/V heads of 128,
MLP 3072) and, to fit a CPU, `--layers` of its 28 layers (default 2) and a `--vocab` of 32K (151,936
with --vocab 151936). Times are the best of `--rounds` round-robin rounds.

    python -m bench.bench_agentic [--layers 2] [--vocab 32768] [--rounds 2] [--quick]
    python -m bench.bench_agentic --screens [--rounds 2] [--quick]

`--screens` (issue 54): the same episodes with screenshots, on a random Qwen2-VL whose text part has
this bench's width (hidden 1024, 16 query and 8 K/V heads of 64, MLP 3072, `--layers` layers) and a
2-block tower (bench_vision's, projecting to 1024, frozen): G = 8 episodes of 4 turns of ~200
tokens that share a ~1K-token prompt and a first screenshot; after each of the first 3 turns a tool
returns a screenshot of 256 visual tokens (each episode its own) and 16 tokens of text. The same three layouts, each
encoding the images it holds (the tower's forward is part of the step): the tree encodes each
distinct screenshot once (`vision.images_for`); one row per episode encodes its own 4; one sample per
turn encodes every screenshot up to its turn, as a per-turn trainer re-reads the context. Targets:
tree ≥ 3× faster than per-turn and ≥ 1.5× faster than rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from backstream import reference_backward, stream_backward
from bench import common


def qwen3_06b_shaped(layers: int, vocab: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def episodes(G: int, prompt: int, turns: int, turn_len: int, tool_len: int, vocab: int, seed: int = 0):
    """G episodes: (sequence, per-token loss weights, the (start, end) of each sampled turn)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prompt,), generator=g)
    out = []
    for _ in range(G):
        parts, spans, pos = [shared], [], prompt
        for k in range(turns):
            n = turn_len + int(torch.randint(-turn_len // 5, turn_len // 5 + 1, (1,), generator=g))
            parts.append(torch.randint(0, vocab, (n,), generator=g))
            spans.append((pos, pos + n))
            pos += n
            if k < turns - 1:
                m = tool_len + int(torch.randint(-tool_len // 5, tool_len // 5 + 1, (1,), generator=g))
                parts.append(torch.randint(0, vocab, (m,), generator=g))
                pos += m
        seq = torch.cat(parts)
        w = torch.zeros(len(seq))
        adv = float(torch.randn((), generator=g))
        for a, b in spans:
            w[a:b] = adv / 1000
        out.append((seq, w, spans))
    return out


def per_turn_samples(eps):
    """Turn k of each episode as its own sample: the context up to the turn's end, loss on the turn."""
    seqs, ws = [], []
    for seq, w, spans in eps:
        for a, b in spans:
            wk = torch.zeros(b)
            wk[a:b] = w[a:b]
            seqs.append(seq[:b])
            ws.append(wk)
    return seqs, ws


def logprob_pass(model, seqs, ws):
    """The no-grad pass a PPO-style trainer runs for π_old: logits from the first loss position on."""
    with torch.no_grad():
        for s, w in zip(seqs, ws):
            first = int(torch.nonzero(w)[0])
            model(input_ids=s[None], logits_to_keep=len(s) - first + 1)


def main(layers=2, vocab=32768, rounds=2, quick=False):
    torch.set_num_threads(2)
    G, P, T, S, R = (8, 1024, 4, 200, 300) if not quick else (2, 64, 2, 16, 24)
    model = qwen3_06b_shaped(layers if not quick else 1, vocab if not quick else 1024)
    eps = episodes(G, P, T, S, R, model.config.vocab_size)
    rows, row_w = [e[0] for e in eps], [e[1] for e in eps]
    turn_seqs, turn_w = per_turn_samples(eps)
    stats = {}

    def tree():
        model.zero_grad(set_to_none=True)
        stats["tree"] = stream_backward(model, rows, row_w, block_size=512).stats

    def by_rows():
        model.zero_grad(set_to_none=True)
        logprob_pass(model, rows, row_w)
        reference_backward(model, rows, row_w)

    def by_turns():
        model.zero_grad(set_to_none=True)
        logprob_pass(model, turn_seqs, turn_w)
        reference_backward(model, turn_seqs, turn_w)

    t0 = time.perf_counter()
    times = common.timed_side_by_side({"tree": tree, "rows": by_rows, "per-turn": by_turns}, rounds=rounds)
    st = stats["tree"]
    row_tokens = sum(len(s) for s in rows)
    turn_tokens = sum(len(s) for s in turn_seqs)
    loss_tokens = sum(int((w != 0).sum()) for w in row_w)
    res = {
        "shape": {"G": G, "prompt": P, "turns": T, "turn_tokens": S, "tool_tokens": R,
                  "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size, "hidden": 1024},
        "tokens": {"tree_unique": st.tree_tokens, "tree_forwarded": st.prefill_tokens + st.backward_tokens,
                   "rows": row_tokens, "rows_forwarded": 2 * row_tokens, "per_turn": turn_tokens,
                   "per_turn_forwarded": 2 * turn_tokens, "loss_tokens": loss_tokens},
        "step_s": times,
        "speedup_vs_rows": times["rows"] / times["tree"],
        "speedup_vs_per_turn": times["per-turn"] / times["tree"],
        "token_ratio_rows_over_tree": row_tokens / st.tree_tokens,
        "fraction_of_token_ratio": (times["rows"] / times["tree"]) / (row_tokens / st.tree_tokens),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}",
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(res, indent=1))
    print(f"\n| layout | tokens in its batch | step time (s) | tree's speed-up |\n|---|---|---|---|\n"
          f"| tree (backstream) | {st.tree_tokens:,} unique | {times['tree']:.1f} | 1.00 |\n"
          f"| one row per episode | {row_tokens:,} | {times['rows']:.1f} | {res['speedup_vs_rows']:.2f} "
          f"(token ratio {res['token_ratio_rows_over_tree']:.2f}: "
          f"{100 * res['fraction_of_token_ratio']:.0f}% of it) |\n"
          f"| one sample per turn | {turn_tokens:,} | {times['per-turn']:.1f} | {res['speedup_vs_per_turn']:.2f} |")
    if not quick:
        with open(os.path.join(common.RESULTS, "agentic.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


# -- screenshot episodes (--screens) -------------------------------------------------------------------

SCREEN_GRID = (16, 16)  # merged tokens of a screenshot: 16 x 16 = 256 visual tokens


def screen(k: int, vision_cfg):
    """Screenshot k: seeded noise as the tower's patches (h x w merged tokens, one frame)."""
    from backstream.stream import vision

    h, w = SCREEN_GRID
    m, T, P, C = vision_cfg.spatial_merge_size, vision_cfg.temporal_patch_size, vision_cfg.patch_size, 3
    g = torch.Generator().manual_seed(1000 + k)
    pixels = torch.randn(h * m * w * m, C * T * P * P, generator=g)
    return vision.Picture(f"screen-{k}", {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h * m, w * m]])},
                          h * w)


def screen_episodes(G: int, prompt: int, turns: int, turn_len: int, tool_text: int, cfg, seed: int = 0):
    """G episodes: (sequence, loss weights, the (start, end) of each sampled turn, its pictures in
    order, and how many of them each turn's context holds)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 100, (n,), generator=g)  # noqa: E731  (text: not the vision ids)
    start, image, end = cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id
    shot = lambda pic: torch.tensor([start] + [image] * pic.tokens + [end])  # noqa: E731
    first = screen(0, cfg.vision_config)
    shared = torch.cat([ids(prompt), shot(first), ids(8)])
    out = []
    for e in range(G):
        parts, spans, pos, pics, seen = [shared], [], len(shared), [first], []
        for k in range(turns):
            n = turn_len + int(torch.randint(-turn_len // 5, turn_len // 5 + 1, (1,), generator=g))
            parts.append(ids(n))
            spans.append((pos, pos + n))
            seen.append(len(pics))
            pos += n
            if k < turns - 1:
                pic = screen(1 + e * turns + k, cfg.vision_config)
                pics.append(pic)
                part = torch.cat([ids(2), shot(pic), ids(tool_text)])
                parts.append(part)
                pos += len(part)
        seq = torch.cat(parts)
        w = torch.zeros(len(seq), dtype=torch.float32)
        adv = float(torch.randn((), generator=g))
        for a, b in spans:
            w[a:b] = adv / 1000
        out.append((seq, w, spans, pics, seen))
    return out


def _forward_nograd(model, seq, images, first: int):
    """The no-grad log-prob pass of one sample with its images (logits from the first loss position)."""
    with torch.no_grad():
        embeds = images.sequence_embeds(images.embed_module(model), 0, seq)
        model(inputs_embeds=embeds, position_ids=images.position_ids(0, seq.device), use_cache=False,
              logits_to_keep=len(seq) - first + 1)


def screens_model(layers: int, seed: int = 0):
    """bench_vision's random Qwen2-VL at this bench's width (the module docstring)."""
    from transformers import AutoModelForImageTextToText

    from bench.bench_vision import vlm_config

    cfg = vlm_config("qwen2_vl")
    cfg.text_config.update(dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=64))
    cfg.vision_config.hidden_size = 1024
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).eval()


def main_screens(layers=2, rounds=2, quick=False):
    from backstream.stream import vision

    torch.set_num_threads(2)
    G, P, T, S, R = (8, 1024, 4, 200, 16) if not quick else (2, 16, 2, 8, 4)
    model = screens_model(layers if not quick else 1)
    model.model.visual.requires_grad_(False)
    cfg = model.config
    eps = screen_episodes(G, P, T, S, R, cfg)
    rows, row_w, row_pics = [e[0] for e in eps], [e[1] for e in eps], [e[3] for e in eps]
    turn_seqs, turn_w, turn_pics = [], [], []
    for seq, w, spans, pics, seen in eps:
        for (a, b), n in zip(spans, seen):
            wk = torch.zeros(b)
            wk[a:b] = w[a:b]
            turn_seqs.append(seq[:b])
            turn_w.append(wk)
            turn_pics.append(pics[:n])
    stats, encoded = {}, {}

    def fresh(pics_of):
        return [[p.fresh() for p in ps] for ps in pics_of]

    def tree():
        model.zero_grad(set_to_none=True)
        pics = fresh(row_pics)  # one object per digest: each screenshot encoded once
        same = {}
        pics = [[same.setdefault(p.digest, p) for p in ps] for ps in pics]
        images = vision.images_for(model, rows, pics, grad=False)
        encoded["tree"] = sum(p.calls for p in same.values())
        stats["tree"] = stream_backward(model, rows, row_w, block_size=512, images=images).stats

    def per_sample(seqs, ws, pics_of, name):
        model.zero_grad(set_to_none=True)
        calls = 0
        for seq, w, pics in zip(seqs, ws, fresh(pics_of)):  # each sample encodes the images it holds
            images = vision.images_for(model, [seq], [pics], grad=False)
            calls += sum(p.calls for p in pics)
            _forward_nograd(model, seq, images, int(torch.nonzero(w)[0]))
            reference_backward(model, [seq], [w], images=images)
        encoded[name] = calls

    t0 = time.perf_counter()
    times = common.timed_side_by_side({
        "tree": tree, "rows": lambda: per_sample(rows, row_w, row_pics, "rows"),
        "per-turn": lambda: per_sample(turn_seqs, turn_w, turn_pics, "per-turn")}, rounds=rounds)
    st = stats["tree"]
    row_tokens, turn_tokens = sum(len(s) for s in rows), sum(len(s) for s in turn_seqs)
    res = {
        "model": "random Qwen2-VL (bench_agentic.screens_model: hidden 1024, "
                 f"{model.config.text_config.num_hidden_layers} layers), float32, tower frozen",
        "shape": {"G": G, "prompt_text": P, "turns": T, "turn_tokens": S, "screenshot_tokens": SCREEN_GRID[0] *
                  SCREEN_GRID[1], "screenshots_per_episode": T, "tool_text_tokens": R},
        "tokens": {"tree_unique": st.tree_tokens, "rows": row_tokens, "per_turn": turn_tokens},
        "encoder_calls": encoded, "step_s": times,
        "speedup_vs_rows": times["rows"] / times["tree"], "speedup_vs_per_turn": times["per-turn"] / times["tree"],
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}", "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(res, indent=1))
    print(f"\n| layout | tokens in its batch | screenshots encoded | step time (s) | tree's speed-up |\n"
          f"|---|---|---|---|---|\n"
          f"| tree (backstream) | {st.tree_tokens:,} unique | {encoded['tree']} | {times['tree']:.2f} | 1.00 |\n"
          f"| one row per episode | {row_tokens:,} | {encoded['rows']} | {times['rows']:.2f} | "
          f"{res['speedup_vs_rows']:.2f} |\n"
          f"| one sample per turn | {turn_tokens:,} | {encoded['per-turn']} | {times['per-turn']:.2f} | "
          f"{res['speedup_vs_per_turn']:.2f} |")
    if not quick:
        print("saved", common.save("agentic_screens", res))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--screens", action="store_true", help="screenshot episodes on a random VLM (issue 54)")
    a = ap.parse_args()
    if a.screens:
        main_screens(a.layers, a.rounds, a.quick)
    else:
        main(a.layers, a.vocab, a.rounds, a.quick)
