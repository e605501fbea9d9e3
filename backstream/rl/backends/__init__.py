"""Who computes the samples: the backend protocols (`base`), the in-process backend (`local/`), a pool
of vLLM servers (`vllm/`), and `build_backend`, the run's for `rollout.backend`.
"""

from __future__ import annotations


def build_backend(cfg, tokenizer, eos: list[int], run_dir: str, dp=None, model=None) -> tuple:
    """The run's backend, its two sides (rl/backends/base.py: `Backend`, `Sync`) for `rollout.backend`: in
    process, or a pool of vLLM servers (rl/backends/vllm/backend.py: started or connected to at the first
    sync, shared by every rank of a torchrun job)."""
    if cfg.rollout.backend != "vllm":
        from backstream.rl.backends.local.backend import LocalBackend, LocalSync  # noqa: PLC0415

        backend = LocalBackend(cfg.rollout, eos, tokenizer)
        return backend, LocalSync(backend)
    from backstream.rl.backends.vllm.backend import build  # noqa: PLC0415  (only a vLLM run needs it)
    from backstream.rl.parallel import DataParallel  # noqa: PLC0415

    return build(cfg, tokenizer, eos, run_dir, dp if dp is not None else DataParallel(), model)
