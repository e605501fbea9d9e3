"""`backstream verify` with an image on every vision-language architecture transformers ships (issue 53).

    python -m scripts.verify_vlm_families                 # all of them: docs/vision_families.md and .json
    python -m scripts.verify_vlm_families --only qwen3_vl gemma3   # re-check a few, merged into the same files
    python -m scripts.verify_vlm_families --jobs 1 --timeout 120 --out docs/vision_families

Walks `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` and, for each model_type, runs in a child process
with a time limit (as `scripts/verify_families.py` does) `verify(model_type, images=True)`: the float64
miniature of its image-text class, one image after the 2nd token of every sequence of the token tree,
the tower trained; then, when that ran (exact or wrong), once more with the tower frozen
(`freeze_vision=True`). The table gives each family's verdict with the tower trained, its worst error,
the image's placeholder count, how far the reference is from the model's own forward from pixels (a
family that uses the image beyond the decoder's input, as Gemma 3's bidirectional image attention does,
is refused there), the frozen verdict and the reason. Whatever the engine does when it runs is what the
table says: rerun it after changing the engine, its guards or the miniature.
"""

from __future__ import annotations

import json
import os
import sys
import time

from scripts.verify_families import KINDS, _md_cell, sweep

SCRIPT = "scripts.verify_vlm_families"


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _one(model_type: str) -> None:
    """Child process: the tower trained, then (if that ran) frozen; one JSON line on stdout."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    from backstream.stream.verify import Verdict, verify

    say = lambda s: print(f"stage: {s}", file=sys.stderr, flush=True)  # noqa: E731
    rep = verify(model_type, images=True, stage=say).to_dict()
    if rep["kind"] in (Verdict.EXACT.value, Verdict.WRONG.value):
        frozen = verify(model_type, images=True, freeze_vision=True, stage=lambda s: say(f"frozen {s}"))
        rep["frozen"] = {"kind": frozen.kind.value, "verdict": frozen.verdict, "worst_error": frozen.worst,
                         "reason": frozen.reason}
    print(json.dumps(rep, default=str))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def write(rows: list[dict], out: str) -> dict:
    counts = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    frozen = [r["frozen"] for r in rows if r.get("frozen")]
    frozen_counts = {k: sum(f["kind"] == k for f in frozen) for k in KINDS}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    import torch
    import transformers

    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "counts": counts, "frozen_counts": frozen_counts, "total": len(rows)}
    with open(out + ".json", "w") as f:
        json.dump({**meta, "families": rows}, f, indent=1, default=str)
    lines = [
        "# Vision families: `backstream verify` with an image, on every image-text-to-text model transformers ships",
        "",
        f"`python -m scripts.verify_vlm_families` (transformers {meta['transformers']}, torch {meta['torch']}, "
        f"{meta['date']}): for each model_type of `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, "
        "`verify(model_type, images=True)`: a float64 miniature of its default config built as its image-text "
        "class (text part as in [families.md](families.md), the vision tower cut to 2 blocks of a tiny image), "
        "one image placed after the 2nd token of every sequence of the GRPO-like token tree, and `stream_backward` "
        "(blocks 1, 3, 16) against `reference_backward` with the tower trained, every gradient (the tower's "
        "included) and log-prob compared; the reference is also compared with the model's own forward from "
        "pixels, and a family whose own forward differs (it uses the image beyond the decoder's input rows, "
        "docs/design.md §2c) is refused. Families that ran are checked again with the tower frozen "
        "(`freeze_vision=True`). The JSON beside this file has every report.",
        "",
        f"**{len(rows)} families (tower trained): " + ", ".join(f"{counts[k]} {k}" for k in KINDS) + ".**"
        + (f" Tower frozen ({len(frozen)} checked): " + ", ".join(f"{frozen_counts[k]} {k}" for k in KINDS if
                                                                   frozen_counts[k]) + "." if frozen else ""),
        "",
        "- exact: every gradient and log-prob within 1e-10 (relative), the reference equal to the model's own "
        "forward from pixels;",
        "- refused: the engine (a `ModelContractError` of the family contract, docs/design.md §6b) or verify's "
        "own-forward check refused it, for the reason given;",
        "- wrong: it ran and the gradient differs (a guard is missing);",
        "- could not build: the miniature, its image or the reference failed (not a verdict on the engine);",
        "- error: `stream_backward` crashed with some other exception.",
        "",
        "Columns: *image tokens*, the placeholders of the test image; *own forward*, the largest log-prob "
        "difference between the reference and the model's own forward from pixels; *frozen*, the verdict (worst "
        "error) with the tower frozen.",
        "",
        "| model_type | verdict | worst error | image tokens | own forward | frozen | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {k: i for i, k in enumerate(("wrong", "error", "exact", "refused", "could not build"))}
    for r in sorted(rows, key=lambda r: (order.get(r["kind"], 9), r["model_type"])):
        fr = r.get("frozen")
        fcell = "-" if not fr else f"{fr['kind']} ({_fmt(fr.get('worst_error'))})"
        tokens = r.get("image_tokens")
        lines.append(f"| {r['model_type']} | {r['kind']} | {_fmt(r.get('worst_error'))} | "
                     f"{'-' if tokens is None else tokens} | {_fmt(r.get('image_forward_error'))} | {fcell} | "
                     f"{_md_cell(r.get('reason', ''))[:400]} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return counts


def _frozen_note(r: dict) -> str:
    fr = r.get("frozen")
    return f"; frozen: {fr['verdict'][:80]}" if fr else ""


def main(argv=None) -> int:
    return sweep(argv, doc=__doc__, families=families, one=_one, write=write, script=SCRIPT, out="docs/vision_families",
                 jobs=1, timeout=120, what="image-text-to-text", note=_frozen_note)


if __name__ == "__main__":
    sys.exit(main())
