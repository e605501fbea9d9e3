"""The context and K/V cache of the vLLM server a run starts: the run's longest sequence, as its
samplers tell it, checked against vllm.max_model_len and the CPU server's K/V cache before the run
folder is written (vLLM would refuse the requests, or exit during a minute of start-up); a model
whose layers keep recurrent or convolution state is refused on a CPU server, and so is a
vision-language model of a type vLLM-CPU cannot serve here (`VLM_ON_CPU`)."""

from __future__ import annotations

import math

import torch

from backstream.checks import UserError
from backstream.stream import vision
from backstream.stream.adapter import probe_layout
from backstream.stream.hf import base_model

KV_BLOCK = 128  # tokens per K/V block of a CPU server (vllm-cpu 0.32.0's default block size)


def float_dtype(tensors) -> torch.dtype:
    """The dtype of the first floating-point tensor: the weights' (an int8 code or a buffer aside)."""
    return next(t.dtype for t in tensors if t.is_floating_point())


def kv_bytes_per_token(config, dtype: torch.dtype) -> tuple[int, str] | None:
    """Bytes of K/V cache a token takes on the server, with the product that gives them: layers × 2
    (key, value) × K/V heads × head dim × the dtype's bytes, from the model's config (full-attention
    layers only, where the config names the layers' kinds); None where the config does not say."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(c, "num_attention_heads", None)
    kinds = getattr(c, "layer_types", None)
    layers = sum(k == "full_attention" for k in kinds) if kinds else getattr(c, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    size = layers * 2 * kv_heads * head_dim * dtype.itemsize
    return size, f"{layers} layers × 2 × {kv_heads} K/V heads × {head_dim} × {dtype.itemsize} bytes"


# what vllm-cpu 0.32.0 did with hybrid models here (2026-11-28; docs/vllm.md): Qwen3.5's model code
# imports Qwen3-VL's image processing, which needs torchvision, which has no build beside the CPU torch;
# Qwen3-Next's Gated DeltaNet runs in bfloat16 only (head dim 128), needs chunked prefill with prefix
# caching (which the run's server turns off: a CPU generator cannot rewind), and without prefix caching
# sampled NaN log-probs on a tiny random model whose transformers forward is finite
HYBRID_ON_CPU = ("which the vLLM CPU server does not run here (vllm-cpu 0.32: Qwen3.5's model code needs torchvision, "
                 "which has no build beside the CPU torch; Qwen3-Next's Gated DeltaNet needs bfloat16 and chunked "
                 "prefill, and sampled NaN log-probs; docs/vllm.md); sample with rollout.backend = \"local\", or run "
                 "the server on a GPU")


# the image-text model types whose vLLM model code imports and serves on vllm-cpu 0.32 here (2026-12-07,
# docs/vllm.md): the others tried (qwen3_5, qwen3_vl, qwen2_5_vl, gemma3, llava) import image or video
# processing that needs torchvision, which has no build beside the CPU torch; a type not tried here
# (qwen2_vl, the tiny VLM's, among them) is refused as well: only what served here is let through
VLM_ON_CPU = ("idefics3",)


class ServerContext:
    """What the run's server must hold: `cfg` its [vllm]; the run's longest sequence (`need_context`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        # the run's longest sequence, and what sets it, as its samplers tell it (`need_context`)
        self.longest, self.longest_why = 0, ""

    def need_context(self, tokens: int, why: str) -> None:
        """A sampler's longest sequence (its longest prompt + rollout.max_new_tokens; an episode's token
        budget), `why` naming what sets it: the server the run starts serves the longest of them
        (vllm.max_model_len = 0), since its K/V cache must hold one whole sequence of its context."""
        if tokens > self.longest:
            self.longest, self.longest_why = tokens, why

    def check(self, model) -> None:
        """The server's context and K/V cache checked against `model` (`context`), before the run folder
        is written; a server of your own has its own (nothing to check here). A model whose layers
        keep recurrent or convolution state is refused on a CPU server (`HYBRID_ON_CPU`)."""
        if not self.cfg.addresses():
            base = base_model(model)
            layout = probe_layout(model)
            if layout.states and not torch.cuda.is_available():
                raise UserError(f"rollout.backend = \"vllm\": {type(base).__name__} keeps recurrent or convolution "
                                f"state in layers {sorted(layout.state_layers)}, {HYBRID_ON_CPU}")
            kind = getattr(base.config, "model_type", "")
            if vision.holds_images(model) and kind not in VLM_ON_CPU and not torch.cuda.is_available():
                raise UserError(f"rollout.backend = \"vllm\": a {kind} vision-language model, which a CPU server "
                                "does not serve here (the vLLM model code of the image-text types tried needs "
                                "torchvision, which has no build beside the CPU torch of the server's environment; "
                                f"vllm-cpu 0.32 serves {', '.join(VLM_ON_CPU)} here; docs/vllm.md); "
                                "sample with rollout.backend = \"local\", or run the server on a GPU")
            self.length(base.config, float_dtype(base.parameters()))

    def length(self, config, dtype: torch.dtype) -> int:
        """The context of the server the run starts: vllm.max_model_len, 0 = the run's longest sequence
        (`need_context`; the model's when no sampler said). Refused by name: a vllm.max_model_len
        shorter than the run's longest sequence (the server would refuse its requests), and a CPU
        server's K/V cache (vllm.kv_cache_gb) that cannot hold one sequence of the context (vLLM exits
        during start-up then, after most of a minute). A GPU server sizes its cache by vLLM's
        --gpu-memory-utilization, not vllm.kv_cache_gb: its own start-up check speaks there."""
        cfg = self.cfg
        if cfg.max_model_len and cfg.max_model_len < self.longest:
            raise UserError(f"vllm.max_model_len = {cfg.max_model_len}: shorter than the run's longest sequence, "
                            f"{self.longest} tokens ({self.longest_why}), whose requests the server would refuse; "
                            "raise it, or set it to 0 (the run's longest sequence)")
        length = cfg.max_model_len or self.longest or getattr(config, "max_position_embeddings", 2048)
        per_token = kv_bytes_per_token(config, dtype)
        if per_token is None or torch.cuda.is_available():
            return length
        size, product = per_token
        block = KV_BLOCK * size
        holds = (cfg.kv_cache_gb * 2**30 // block - 1) * KV_BLOCK  # vLLM holds one block back (its null block)
        if length > holds:
            gb = math.ceil((-(-length // KV_BLOCK) + 1) * block / 2**30)
            what = f"vllm.max_model_len = {length}" if cfg.max_model_len else \
                f"vllm.max_model_len = 0: the run's longest sequence, {length} tokens ({self.longest_why})" \
                if self.longest else f"vllm.max_model_len = 0: the model's context, {length} tokens"
            lower = "vllm.max_model_len" if cfg.max_model_len or not self.longest else "what sets that length"
            raise UserError(f"vllm.kv_cache_gb = {cfg.kv_cache_gb}: the server's K/V cache holds {max(holds, 0)} "
                            f"tokens of this model ({size} bytes a token: {product}), fewer than one sequence of "
                            f"{what}, which vLLM refuses to start with; set vllm.kv_cache_gb = {gb}, or lower "
                            f"{lower}")
        return length
