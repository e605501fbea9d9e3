"""`backstream verify` on every causal-LM architecture transformers ships.

    python -m scripts.verify_families                  # all of them: docs/families.md and docs/families.json
    python -m scripts.verify_families --only gemma2 llama4_text   # re-check a few, merged into the same files
    python -m scripts.verify_families --jobs 2 --timeout 300 --out docs/families

Walks `transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, and for each
model_type runs `backstream.stream.verify.verify(model_type)` (the default config of that type, made tiny)
in a child process with a time limit, since a miniature may hang or take long. Writes a table
(model_type, verdict, worst error, reason) with the counts per verdict, and the full reports as JSON.
Whatever the engine does at the time it runs is what the table says: rerun it after changing the
engine or its guards.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

from backstream.stream.verify import Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = tuple(v.value for v in Verdict)


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _one(model_type: str) -> None:
    """Child process: verify one family, JSON on the last line of stdout, stages on stderr."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    from backstream.stream.verify import verify

    rep = verify(model_type, images=False, stage=lambda s: print(f"stage: {s}", file=sys.stderr, flush=True))
    print(json.dumps(rep.to_dict(), default=str))


def run_family(model_type: str, timeout: float, script: str = "scripts.verify_families") -> dict:
    """`python -m <script> --child <model_type>` with a time limit: its report (the JSON on the last
    line of its stdout), or a row saying where it timed out or how it failed."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", script, "--child", model_type]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        stages = [line[7:] for line in err.splitlines() if line.startswith("stage: ")]
        last = stages[-1] if stages else "start"
        kind = Verdict.ERROR if last.startswith("stream_backward") else Verdict.COULD_NOT_BUILD
        where = "in stream_backward" if kind is Verdict.ERROR else f"at step '{last}'"
        return _row(model_type, kind, f"timed out after {timeout:.0f} s {where}", time.perf_counter() - t0)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = " ".join((p.stderr or "").strip().splitlines()[-1:])[:300]
        return _row(model_type, Verdict.COULD_NOT_BUILD, f"the child process failed (exit {p.returncode}): {tail}",
                    time.perf_counter() - t0)
    rep = json.loads(lines[-1])
    rep["model_type"] = model_type  # as listed (a composite type reports its text model's type otherwise)
    return rep


def _row(model_type: str, kind: Verdict, reason: str, seconds: float) -> dict:
    return {"model_type": model_type, "verdict": f"{kind.value}: {reason}", "kind": kind.value, "reason": reason,
            "worst_error": None, "architecture": "", "features": {}, "seconds": round(seconds, 1)}


def _md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def write(rows: list[dict], out: str) -> dict:
    counts = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    import torch
    import transformers

    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "counts": counts, "total": len(rows)}
    with open(out + ".json", "w") as f:
        json.dump({**meta, "families": rows}, f, indent=1, default=str)
    lines = [
        "# Families: `backstream verify` on every causal LM transformers ships",
        "",
        f"`python -m scripts.verify_families` (transformers {meta['transformers']}, torch {meta['torch']}, "
        f"{meta['date']}): for each model_type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a float64 miniature of its "
        "default config (2+ layers, width 32, every layer type kept, windows/chunks of 4; a multimodal type is "
        "checked through its text model) and `stream_backward` against `reference_backward` on a GRPO-like "
        "token tree at block sizes 1, 3, 16. The JSON beside this file has every report.",
        "",
        "A row is about the *default* config of its type: a checkpoint may switch on what the default leaves "
        "off (LFM2's default has no convolution layers, BERT-likes are built with `is_decoder=True`), so check "
        "the model you train with `backstream verify <hub id or folder>`.",
        "",
        f"**{len(rows)} families: " + ", ".join(f"{counts[k]} {k}" for k in KINDS) + ".**",
        "",
        "- exact: every parameter's gradient and every log-prob within 1e-10 (relative);",
        "- refused: the engine refused the model (a `ModelContractError`, `model: …`, from a guard of the family "
        "contract, docs/design.md §6b);",
        "- wrong: it ran and the gradient differs (the worst outcome: a guard is missing);",
        "- could not build: the miniature or the reference itself failed (not a verdict on the engine);",
        "- error: `stream_backward` crashed with some other exception.",
        "",
        "| model_type | verdict | worst error | reason |",
        "|---|---|---|---|",
    ]
    order = {k: i for i, k in enumerate(("wrong", "error", "refused", "could not build", "exact"))}
    for r in sorted(rows, key=lambda r: (order.get(r["kind"], 9), r["model_type"])):
        worst = r.get("worst_error")
        w = "-" if worst is None else f"{worst:.1e}"
        lines.append(f"| {r['model_type']} | {r['kind']} | {w} | {_md_cell(r.get('reason', ''))[:400]} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return counts


def sweep(argv, *, doc: str, families, one, write, script: str, out: str, jobs: int, timeout: float, what: str,
          note=lambda r: "") -> int:
    """The command line both sweeps share: each of `families()` (or --only's) verified by `one` in a child
    process of `script` under a time limit, --jobs at a time, the rows (merged into --out's JSON with
    --only) written by `write`; `note(row)` adds to each progress line, `what` names the families."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these model_types only (merged into --out)")
    ap.add_argument("--out", default=out, help="output path without extension (.md and .json)")
    ap.add_argument("--jobs", type=int, default=jobs, help="families verified in parallel (2 at most on 2 cores)")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per family")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        one(args.child)
        return 0
    names = families()
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"--only: not {what} model types of this transformers: {unknown}", file=sys.stderr)
            return 2
        names = list(args.only)
    rows: dict[str, dict] = {}
    if args.only and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            rows = {r["model_type"]: r for r in json.load(f)["families"]}
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_family, n, args.timeout, script): n for n in names}
        for i, fut in enumerate(cf.as_completed(futures), 1):
            r = fut.result()
            rows[r["model_type"]] = r
            worst = r.get("worst_error")
            print(f"[{i}/{len(names)} {time.perf_counter() - t0:.0f}s] {r['model_type']}: {r['verdict'][:160]}"
                  + (f" (worst {worst:.1e})" if worst is not None else "") + note(r), flush=True)
    counts = write(list(rows.values()), args.out)
    print(f"{len(rows)} families: " + ", ".join(f"{counts[k]} {k}" for k in KINDS))
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


def main(argv=None) -> int:
    return sweep(argv, doc=__doc__, families=families, one=_one, write=write, script="scripts.verify_families",
                 out="docs/families", jobs=2, timeout=300, what="causal-LM")


if __name__ == "__main__":
    sys.exit(main())
