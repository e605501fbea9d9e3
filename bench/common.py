"""Shared pieces of the benchmarks: a tiny model of realistic shape, timing, peak-memory probes."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def model(vocab=8192, hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, inter=1024, dtype=torch.float32, seed=0):
    """A Qwen3 of small width but realistic proportions: GQA 3:1, MLP 2.7×, and an LM head that
    costs a third of the body per token, as in Qwen3-0.6B (the long-trajectory bench uses a 32K
    vocabulary, where the logits dominate memory as they do in real GRPO runs)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=65536, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def timed(fn, repeats=3):
    """Best wall time of `repeats` calls (the first may include one-off allocations)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def timed_side_by_side(fns: dict, rounds=3) -> dict:
    """Best wall time of each function over `rounds` round-robin rounds: a slow spell of the
    machine hits every method, not one."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak growth of the resident set during a `with` block, sampled every millisecond.

    The process's lifetime high-water mark (ru_maxrss) would hide a call whose peak stays below
    what model creation reached; large tensors are mmap-ed and unmapped when freed, so the
    resident set follows the live tensors closely.
    """

    def __enter__(self):
        import ctypes
        import threading

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so the baseline is the live set
        except OSError:
            pass
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_bytes())
                self._stop.wait(0.001)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.base


def peak_in_subprocess(module: str, args: dict) -> dict:
    """Run `python -m module` with JSON args in a fresh process; it prints one JSON line."""
    # glibc raises its mmap threshold after large frees, and the heap it then grows is not given
    # back: the resident set would keep the high-water mark of freed tensors. A fixed threshold
    # makes every tensor over 64 KiB its own mapping, so the resident set follows the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-m", module, json.dumps(args)], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def save(name: str, payload) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    line = lambda vals: "| " + " | ".join(str(v).rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cols), rule] + [line([r[c] for c in cols]) for r in rows])
