"""The run's vLLM server and the learner's weights on it (`WeightPublisher`): the server started (or
connected to) with the policy's weights, the learner's new weights published before any request after
they changed, the weight version its tokens are labelled with, and what QaRL asks of it. Beside it in
rl/vllm/: the server's context and K/V cache (context.py), the generate calls (requests.py); the
backend protocol over the three is rl/backends/server.py.

- Publishing the weights: full weights are written as safetensors and reloaded in place by the
  server's worker extension (rl/vllm/worker_ext.py: re-ties and repacks a tied head on a CPU server),
  between /pause and /resume, with the prefix cache reset (cached prompt K/V of the old weights would
  be reused otherwise); a LoRA policy publishes its adapter instead (/v1/load_lora_adapter,
  load_inplace). Every token records the weight version it was sampled with (vLLM's own label).
- The server's log-probs are the learner's convention, log_softmax(logits / T) before truncation:
  `--logprobs-mode processed_logprobs`, or with top-p/top-k (which vLLM's processed log-probs are
  renormalised after) `raw_logprobs`, the same at T = 1; top-p/top-k at another temperature are
  refused (server.logprobs_mode).
- QaRL: the server reports its int8 GEMM (`kernels`), which the trainer's rollout source sets on the
  learner, and `check_aligned` refuses a server whose quantized forward differs from the learner's.
- Under torchrun every rank is a client of one server, which rank 0 starts (or connects to); each
  rank sends the requests of its own groups. Publishing is a collective: the weights are gathered
  whole from their FSDP shards, rank 0 writes them and has the server reload them, and every rank
  waits for it before sampling.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import torch

from backstream.checkpoint import quiet
from backstream.checks import UserError
from backstream.log import log
from backstream.quant.export import write_compressed
from backstream.quant.formats import INT8_GEMMS
from backstream.quant.linear import quant_linears, quantized
from backstream.rl.parallel import DataParallel
from backstream.rl.vllm.context import ServerContext, float_dtype
from backstream.rl.vllm.serve import Needs, check_server
from backstream.rl.vllm.server import SERVED_NAME, Server, ServerError, VLLMConfig, free_port, server_args
from backstream.stream import fsdp
from backstream.stream.engine import logprobs
from backstream.stream.hf import base_model

ADAPTER = "policy-lora"  # the served name of a LoRA policy's adapter
# what a publish does with the requests in flight: vLLM's /pause mode for each rollout.in_flight
PAUSE_MODES = {"wait": "wait", "resume": "abort", "keep": "keep"}
ALIGNED_MEDIAN = 1e-4  # QaRL's start-up check: an aligned server is ~1e-7 off the learner, a misaligned one ~1e-2
ALIGN_PROBE = 64  # tokens of that check's prompt (`WeightPublisher.check_aligned`)


def _base_names(model, state: dict) -> dict:
    """The base model's weights under its own names, from `model`'s state dict: PEFT's prefix and
    wrappers removed (`x.base_layer.weight` is `x.weight`; the adapters' own tensors left out)."""
    base = base_model(model)
    prefix = next(name for name, m in model.named_modules() if m is base)
    prefix = prefix + "." if prefix else ""
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state.items()
            if k.startswith(prefix) and ".lora_" not in k}


def starting(progress, n: int):
    """A sampler's `progress` told of the server's start-up (seconds so far), or None."""
    if progress is None:
        return None
    return lambda seconds: progress(0, n, f"starting the vLLM server, {seconds:.0f} s")


def lora_rank(model) -> int:
    """The largest rank of a PEFT policy's adapters (what the server's --max-lora-rank must hold); 0 without."""
    return max(c.r for c in model.peft_config.values()) if hasattr(model, "peft_config") else 0


class WeightPublisher:
    """The server's side of a run: started (or connected to) at the first rollout with the policy's
    weights, and handed the learner's new weights before any rollout after they changed.

    Under torchrun (`dp`: the run's rl/parallel.py object) every rank is a client of one server, and
    `ensure` is a collective that every rank calls at every rollout round (an empty share too): rank
    0 starts the server (or connects to vllm.url) and the others learn its URL; whether the weights
    changed is decided over every rank (versions are counted per shard); the whole weights are
    gathered from their FSDP shards, rank 0 writes them and has the server reload them, and no rank
    samples before it is done. Rank 0's errors (the server did not start, a reload failed) are raised
    on every rank; so are a rank's failed requests, through `dp.fail_together` after each round."""

    def __init__(self, cfg: VLLMConfig, tokenizer, run_dir: str, seed: int, dp: DataParallel | None = None,
                 mode: str = "processed_logprobs", quant=None, policy=None, in_flight: str = "wait", server=None):
        """`policy`: the run's [model] (a server of your own is checked against its name, dtype and
        LoRA before the run folder is written; the defaults' without it, the model's own at the start).
        `in_flight`: what a publish does with the requests in flight (`PAUSE_MODES`): "wait" for them
        (the synchronous loop, where none is), "resume" them from their tokens so far with the new
        weights, or "keep" them (their next tokens sampled with the new weights after the old K/V).
        `server`: an object with `Server`'s methods to talk to instead of the one the run would start or
        connect to (a test's stand-in)."""
        if in_flight not in PAUSE_MODES:
            raise UserError(f"rollout.in_flight: got {in_flight!r}, expected \"keep\" or \"resume\"")
        self.cfg, self.tok, self.run_dir, self.seed, self.mode = cfg, tokenizer, run_dir, seed, mode
        self.in_flight = in_flight
        # QaRL: the run's [quant] when the sampler runs low-bit weights: the server gets them compressed
        self.quant = quant if quant is not None and quant.enabled else None
        self.dp = dp if dp is not None else DataParallel(None)
        self.dir = os.path.abspath(os.path.join(run_dir, "vllm"))  # a server of your own may have another cwd
        self.log_path = os.path.join(run_dir, "vllm.log")
        self.server: Server | None = None
        self.stand_in = server
        self.gemm_info: dict | None = None  # the server's int8 GEMM (`kernels`), asked once
        self.seen: tuple | None = None  # this rank's versions of the weights the server holds
        self.version = 0  # the learner's step that made the weights the server holds (0: the initial ones)
        self.learner_step = 0  # the step that made the learner's current weights (`at_step`)
        self.published = 0  # how many times weights were published (their folders' names)
        self.lora = False
        self.sync_s = 0.0  # seconds the last `ensure` spent publishing weights
        self.context = ServerContext(cfg)  # the server's context and K/V cache, before the run folder
        if self.quant is not None and self.quant.aligned:  # the server must take QaRL's start-up probe too
            self.context.need_context(ALIGN_PROBE + 1, f"QaRL's alignment check: a prompt of {ALIGN_PROBE} tokens + 1")
        if not cfg.url:
            self.dp.on_main(cfg.interpreter)  # no vLLM environment: said now, before the run folder is written
            return
        if self.quant is not None:
            raise UserError(f"vllm.url with quant.rollout = \"{quant.rollout}\": the server must start from the "
                            "policy's compressed weights, which a server of your own does not; leave vllm.url empty "
                            "(the run starts its server from them)")
        self.needs = Needs(model=policy.name if policy is not None else "default", mode=mode,
                           dtype=policy.dtype if policy is not None else "float32",
                           lora_rank=policy.lora_r if policy is not None else 0)
        # a server that cannot serve the run (or none at vllm.url) is refused now, before the run folder
        self.dp.on_main(lambda: self._connect(self.needs))

    def model_name(self) -> str:
        return ADAPTER if self.lora else SERVED_NAME

    def _connect(self, needs: Needs) -> Server:
        """Rank 0: the server at vllm.url, checked to serve `needs` (serve.check_server, which refuses it with
        the `backstream vllm serve` command that starts a right one)."""
        if self.stand_in is not None:
            return self.stand_in
        server = Server.connect(self.cfg.url, self.cfg.request_timeout_s, self.cfg.key())
        check_server(server, needs, self.run_dir)
        return server

    def at_step(self, step: int) -> None:
        """The learner's weights are now those of `step`: what the next publish will be labelled."""
        self.learner_step = step

    def ensure(self, model, progress=None) -> Server:
        """The server, holding `model`'s current weights (`sync_s`: what publishing them took now);
        `progress(seconds)` while it starts."""
        self.sync_s = 0.0
        if self.server is None:
            self._start(model, progress)
        elif self.dp.any(fsdp.versions(model) != self.seen):  # a shard changed on some rank: every rank publishes
            t = time.perf_counter()
            self._publish(model)
            self.sync_s = time.perf_counter() - t
        elif self.version != self.learner_step:  # a step that changed no weight (every advantage 0): the server
            self.version = self.learner_step  # holds this step's weights too, and labels its tokens so
            self.dp.on_main(lambda: self._label(self.version))
        return self.server

    def _label(self, version: int) -> None:
        """Rank 0: the server labels the tokens it samples from now on with `version` (vLLM's per-token
        weight versions, which /inference/v1/generate returns)."""
        self.server.post("/update_weight_version", {"new_version": str(version)})

    def _start(self, model, progress) -> None:
        self.lora = hasattr(model, "peft_config")
        timeout = self.cfg.request_timeout_s
        if self.cfg.url:
            # the user's server holds unknown weights: ours are published now, once it is checked again
            # against the model itself (a model passed in code: its LoRA rank and dtype) and the run folder
            dtype = str(float_dtype(model.parameters())).removeprefix("torch.")
            needs = dataclasses.replace(self.needs, dtype=dtype, lora_rank=lora_rank(model))
            self.server = self.dp.on_main(lambda: self._connect(needs)) or \
                Server(self.cfg.url, None, None, timeout, self.cfg.key())
            self._publish(model)
            return
        weights = fsdp.full_state_dict(model)  # every rank: the base model's, whole, on rank 0
        self.server = self.dp.on_main(lambda: self._launch(model, _base_names(model, weights), progress))
        # the server has loaded it: on disk `initial/` would be a second whole copy of the model for the whole run
        self.dp.on_main(lambda: shutil.rmtree(os.path.join(self.dir, "initial"), ignore_errors=True))
        url = self.dp.broadcast(self.server.url if self.server is not None else None)
        if self.server is None:  # a client of rank 0's server, whose log is in the shared run folder
            self.server = Server(url, None, self.log_path, timeout, self.cfg.key())
        if self.lora:
            self._publish(model)
        else:  # started from the learner's current weights (a resumed run's: its checkpoint's step)
            self.seen, self.version = fsdp.versions(model), self.learner_step
            self.dp.on_main(lambda: self._label(self.version))

    def kernels(self) -> dict[str, str]:
        """QaRL (quant.aligned with an int8 format): the server's int8 GEMM, for the learner to copy
        ({"int8_gemm": name}; worker_ext._int8_gemm runs the kernel on a probe: oneDNN without VNNI
        saturates pairs of products in int16); {} otherwise. The server has started (`ensure`). Asked of
        the server once: its kernel does not change, and a probe after a reload disturbed the int8
        layers' kept scales (measured: 18% of tokens 1e-4..1e-2 off the learner after it)."""
        if self.quant is None or not self.quant.aligned or not self.quant.format.int8_gemm:
            return {}
        if self.gemm_info is None:
            self.gemm_info = self.server.post("/collective_rpc", {"method": "backstream_int8_gemm"})["results"][0]
        info = self.gemm_info
        if info["gemm"] not in INT8_GEMMS:
            raise UserError(f"quant.rollout = \"{self.quant.rollout}\": the server's int8 GEMM ({info}) is none "
                            "the learner can copy; set quant.aligned = false (the mismatch is then measured and "
                            f"corrected: docs/vllm.md) or quant.rollout = \"fp8\"; {self.server.where()}")
        return {"int8_gemm": info["gemm"]}

    def check_aligned(self, model, tokens: int = ALIGN_PROBE) -> None:
        """QaRL: the aligned learner (its int8 GEMM the server's, `kernels`) computes what this server's
        low-bit kernels compute on this machine: the server's log-probs of `tokens` fixed tokens
        (prompt_logprobs) are compared with the learner's quantized forward, and a server that computes
        something else is refused by name. Nothing without quant.aligned."""
        if self.quant is None or not self.quant.aligned:
            return
        gemm = next((m.gemm for m in quant_linears(model).values() if m.format.int8_gemm), "exact")
        ids = torch.randint(0, len(self.tok), (tokens,), generator=torch.Generator().manual_seed(0))
        answer = self.server.post("/v1/completions", {
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
                            f"quant.rollout; {self.server.where()}")

    def _launch(self, model, weights: dict, progress) -> Server:
        """Rank 0: the server, started from `weights` (the base model's, under its own names)."""
        base = base_model(model)
        initial = os.path.join(self.dir, "initial")
        shutil.rmtree(initial, ignore_errors=True)
        dtype = float_dtype(weights.values())  # before writing: save_pretrained empties the dict it is handed
        length = self.context.length(base.config, dtype)  # refused here, before a minute of start-up, if it cannot fit
        self._write(model, weights, initial, self.tok)
        dtype = str(dtype).removeprefix("torch.")
        rank = lora_rank(model)
        log.info(f"vllm: starting the server (its log: {self.log_path})")
        if self.stand_in is not None:
            return self.stand_in
        return Server.start(self.cfg, server_args(initial, free_port(), length, dtype, self.seed, rank, self.mode),
                            self.log_path, progress)

    def _publish(self, model) -> None:
        weights = fsdp.full_state_dict(model, trainable_only=self.lora)  # every rank; whole on rank 0
        # rank 0 writes and reloads; the others wait for it in `on_main`, so none samples old weights
        self.dp.on_main(lambda: self._reload(model, weights, self.learner_step))
        self.version, self.published = self.learner_step, self.published + 1
        self.seen = fsdp.versions(model)

    def _write(self, model, weights: dict, out: str, tokenizer=None) -> None:
        """The base model's weights (`weights`, under its own names) as a folder the server loads: the
        low-bit ones in compressed-tensors with `quant` (as the learner's quantized forward has them,
        from its master weights), else as they are."""
        with quiet():
            if self.quant is not None:
                write_compressed(model, self.quant.format, self.quant.group_size, out, tokenizer)
            else:
                base_model(model).save_pretrained(out, safe_serialization=True, state_dict=weights)
                if tokenizer is not None:
                    tokenizer.save_pretrained(out)

    def _reload(self, model, weights: dict, version: int) -> None:
        """Rank 0: `weights` written as safetensors and loaded by the server in place, between /pause and
        /resume (the requests in flight waited for, aborted or kept: `in_flight`); the tokens sampled
        after are labelled `version`, and the prefix cache is reset (cached prompt K/V are the old
        weights'; with in_flight = "keep" the paused requests hold their blocks and the reset cannot
        free them: requests then key their cache by the version, `cache_salt`)."""
        out = os.path.join(self.dir, f"weights-{self.published + 1}")
        shutil.rmtree(out, ignore_errors=True)
        with quiet():
            if self.lora:
                model.save_pretrained(out, state_dict=weights)  # the adapter alone
            else:
                self._write(model, _base_names(model, weights), out)
        # /pause's own clearing (on by default in vllm 0.32.0) is deprecated there: the reset below is the
        # one mechanism, which the tests can see
        self.server.post(f"/pause?mode={PAUSE_MODES[self.in_flight]}&clear_cache=false")
        try:
            if self.lora:
                self.server.post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": out,
                                                           "load_inplace": True})
            else:
                self.server.post("/collective_rpc", {"method": "backstream_reload", "kwargs": {"path": out}})
            self._label(version)
            if self.in_flight != "keep":
                self._reset_prefix_cache()
        finally:
            self.server.post("/resume")
        if self.published > 0:
            shutil.rmtree(os.path.join(self.dir, f"weights-{self.published}"), ignore_errors=True)

    def _reset_prefix_cache(self) -> None:
        """Reset the server's prefix cache, which vLLM refuses (`success: false`) while a request holds
        blocks: an aborted request lets go of them within moments."""
        for _ in range(50):
            if self.server.post("/reset_prefix_cache") in ({"success": True}, "", None):
                return
            time.sleep(0.1)
        raise ServerError(f"vLLM /reset_prefix_cache: refused for 5 s after a publish (a request still holds "
                          f"cached blocks); {self.server.where()}")

    def close(self) -> None:
        """Stop the server the run started, and delete the weights published to it: a server (this run's,
        now stopped, or the user's, which loaded them) has no need of them, and train.keep_checkpoints
        alone bounds what a run leaves on disk."""
        if self.server is not None:
            self.server.stop()  # rank 0's; a client's holds no process
            self.server = None
        if self.dp.main:
            shutil.rmtree(self.dir, ignore_errors=True)
