"""Who computes the samples: the protocols a backend implements and what the run holds of one
(`base`: `Backend`, `Weights`, `Sampling`, `SamplingParams`), the in-process backend (`local/`), a pool of
vLLM servers (`vllm/`), and `build_backend`, the run's for `rollout.backend`."""

from __future__ import annotations


def build_backend(rollout, vllm, *, policy, quant, seed: int, tokenizer, eos: list[int], run_dir: str, model,
                  dp=None, processor=None):
    """What the run samples with (rl/backends/base.py `Sampling`), for `rollout.backend` of [rollout]
    `rollout`: in process, or a pool of vLLM servers (rl/backends/vllm/backend.py: started or connected to
    at the first sync, shared by every rank of a torchrun job; `vllm`: [vllm], `policy`: [model],
    `quant`: [quant], `seed`: train.seed, `processor`: a VLM's, which the servers' folder gets)."""
    from backstream.rl.backends.base import Sampling  # noqa: PLC0415  (this package's root imports nothing)

    if rollout.backend != "vllm":
        from backstream.rl.backends.local.backend import LocalBackend  # noqa: PLC0415

        backend = LocalBackend(rollout.sampling(), eos, tokenizer)
        return Sampling(backend=backend, weights=backend.weights)
    from backstream.rl.backends.vllm.backend import build  # noqa: PLC0415  (only a vLLM run needs it)

    return build(rollout.sampling(), vllm, in_flight=rollout.in_flight, max_staleness=rollout.max_staleness,
                 policy=policy, quant=quant, seed=seed, tokenizer=tokenizer, eos=eos, run_dir=run_dir, model=model,
                 dp=dp, processor=processor)
