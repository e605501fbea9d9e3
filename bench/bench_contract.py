"""What the family contract's run-time checks cost: `stream_backward` with the checks as shipped
against the same call with the mask check replaced by a constant answer (the other checks are
per-layer identity and keyword tests, free by comparison). The mask check evaluates the model's
mask function over the whole [queries × keys] grid once per forward and mask type.

    python -m bench.bench_contract            # writes bench/results/contract.json
"""

from __future__ import annotations

import json
import os

import torch
from transformers.masking_utils import AttentionMaskInterface

from backstream import stream_backward
from backstream.stream import engine, family
from bench.common import RESULTS, model, timed_side_by_side


def main() -> None:
    torch.manual_seed(0)
    m = model()
    rows = []
    for length, block in ((2048, 256), (4096, 512), (8192, 1024)):
        seq = torch.randint(0, 8192, (length,))
        w = torch.zeros(length)
        w[length // 2:] = 1.0

        def run():
            m.zero_grad(set_to_none=True)
            stream_backward(m, [seq], [w], block_size=block)

        def run_unchecked():
            AttentionMaskInterface.register(engine.ATTN_NAME, lambda *a, **k: family.MaskInfo(None))
            try:
                run()
            finally:
                AttentionMaskInterface.register(engine.ATTN_NAME, family.mask_info)

        t = timed_side_by_side({"checked": run, "unchecked": run_unchecked}, rounds=3)
        rows.append({"length": length, "block": block, "checked_s": round(t["checked"], 3),
                     "unchecked_s": round(t["unchecked"], 3), "overhead": round(t["checked"] / t["unchecked"] - 1, 4)})
        print(rows[-1], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "contract.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
