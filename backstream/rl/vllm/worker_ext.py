"""Runs inside the vLLM server (`--worker-extension-cls backstream.rl.vllm.worker_ext.WeightSync`, the
package's folder on the server's PYTHONPATH): the learner's weights, reloaded in place. Imports
nothing of backstream (the server's environment has vLLM's own transformers, not ours).

On a CPU server vLLM's GEMM keeps its own packed copy of each linear weight; `reload_weights`
repacks the layers it loads, but a tied LM head is loaded through the embedding and keeps sampling
with the old packed copy (log-probs 7e-2 off the new weights, ../shared/VLLM.md). So after the
reload the head is re-tied to the embedding and repacked.

Low-bit weights (QaRL, compressed-tensors): `reload_weights` redoes each layer's
`process_weights_after_loading` on fresh tensors and copies the results into the old storages. The
CPU int8 kernel (oneDNN) keeps a raw pointer to the `weight_scale` tensor it was built with, which
the reload frees: sampling then returned NaN/inf log-probs. The kernels are made to keep that tensor
alive (`_keep_int8_scales`)."""

from __future__ import annotations

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


class WeightSync:
    """Methods of the vLLM worker, called through `/collective_rpc`."""

    def backstream_reload(self, path: str) -> int:
        """Load every weight of the safetensors files in `path` in place; returns the tensors repacked."""
        _keep_int8_scales(self.model_runner.get_model())
        self.model_runner.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        from vllm.platforms import current_platform  # noqa: PLC0415

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415

        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # vLLM's decoder models
        config = self.model_runner.model_config.hf_config
        tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
        if head is None or embed is None or not tied or not hasattr(head, "weight"):
            return 0
        head.weight = embed.weight
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return 1
