"""QaRL on vLLM (docs/quant.md): what a server's low-bit kernels compute, asked of one server of the pool
(they run one wheel on one machine): the int8 GEMM the learner copies (`kernels`), and the check that
the aligned learner's quantized forward gives the server's log-probs (`check_aligned`)."""

from __future__ import annotations

import torch

from backstream.checks import UserError
from backstream.log import log
from backstream.quant.formats import INT8_GEMMS
from backstream.quant.linear import quant_linears, quantized
from backstream.rl.backends.vllm.server import SERVED_NAME
from backstream.stream.engine import logprobs

ALIGNED_MEDIAN = 1e-4  # an aligned server is ~1e-7 off the learner, a misaligned one ~1e-2
ALIGN_PROBE = 64  # tokens of the check's prompt


class Alignment:
    """`quant`: the run's [quant] when the sampler runs low-bit weights (None: nothing to align);
    `server()`: a live server of the pool; `vocab`: the tokenizer's size (the probe's tokens)."""

    def __init__(self, quant, server, vocab: int):
        self.quant = quant if quant is not None and quant.enabled else None
        self.server, self.vocab = server, vocab
        self.gemm_info: dict | None = None

    @property
    def probes(self) -> bool:
        """Whether `check_aligned` sends a probe (its prompt must fit the server's context)."""
        return self.quant is not None and self.quant.aligned

    def kernels(self) -> dict[str, str]:
        """quant.aligned with an int8 format: the server's int8 GEMM, for the learner to copy
        ({"int8_gemm": name}; worker_ext._int8_gemm runs the kernel on a probe: oneDNN without VNNI
        saturates pairs of products in int16); {} otherwise. Asked once: a server's kernel does not
        change, and a probe after a reload disturbed the int8 layers' kept scales (18% of tokens
        1e-4..1e-2 off the learner after it)."""
        if self.quant is None or not self.quant.aligned or not self.quant.format.int8_gemm:
            return {}
        server = self.server()
        if self.gemm_info is None:
            self.gemm_info = server.post("/collective_rpc", {"method": "backstream_int8_gemm"})["results"][0]
        info = self.gemm_info
        if info["gemm"] not in INT8_GEMMS:
            raise UserError(f"quant.rollout = \"{self.quant.rollout}\": the server's int8 GEMM ({info}) is none "
                            "the learner can copy; set quant.aligned = false (the mismatch is then measured and "
                            f"corrected: docs/vllm.md) or quant.rollout = \"fp8\"; {server.where()}")
        return {"int8_gemm": info["gemm"]}

    def check_aligned(self, model, tokens: int = ALIGN_PROBE) -> None:
        """The aligned learner (its int8 GEMM the server's, `kernels`) computes what the server's
        low-bit kernels compute on this machine: the server's log-probs of `tokens` fixed tokens
        (prompt_logprobs) against the learner's quantized forward; a server that computes something
        else is refused by name. Nothing without quant.aligned."""
        if not self.probes:
            return
        server = self.server()
        gemm = next((m.gemm for m in quant_linears(model).values() if m.format.int8_gemm), "exact")
        ids = torch.randint(0, self.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
        answer = server.post("/v1/completions", {
            "model": SERVED_NAME, "prompt": [ids.tolist()], "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0, "skip_special_tokens": False})
        served = answer["choices"][0]["prompt_logprobs"][1:]  # the first token has none
        server_lp = torch.tensor([d[str(int(t))]["logprob"] for d, t in zip(served, ids[1:])], dtype=torch.float64)
        mask = torch.ones(tokens, dtype=torch.bool)
        mask[0] = False
        with torch.no_grad(), quantized(model, True):
            learner_lp = logprobs(model, [ids], [mask])[0][1:].double()
        gaps = (learner_lp - server_lp).abs()
        median = float(gaps.median())
        log.info(f"vllm: QaRL alignment: the server's int8 GEMM is {gemm}; learner vs server on {tokens - 1} "
                 f"tokens: median |Δ log p| {median:.1e}, max {float(gaps.max()):.1e}")
        if not median <= ALIGNED_MEDIAN:
            raise UserError(f"quant.aligned = true: the server's {self.quant.rollout} kernels compute other log-probs "
                            f"than the learner's quantized forward on this machine (median |Δ log p| {median:.1e} over "
                            f"{tokens - 1} tokens, aligned servers give ~1e-7; int8 GEMM: {gemm}); set quant.aligned "
                            "= false (the mismatch is then measured and corrected: docs/vllm.md) or try another "
                            f"quant.rollout; {server.where()}")
