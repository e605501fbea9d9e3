"""The vLLM tests' helpers (tests/rl/vllm/): a server backend as a run holds it (rl/backends/base.py
`Sampling`)."""

import torch
from helpers import KEY

from backstream import config
from backstream.quant.linear import QuantConfig
from backstream.rl.backends import build_backend
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.vllm.server import logprobs_mode
from backstream.rl.parallel.dataparallel import DataParallel
from backstream.rl.rollout.completions import CompletionSampler
from backstream.rl.rollout.source import Source


class Served:
    """A server backend (rl/backends/__init__.py `build_backend`) for `model` (its LoRA decides the way
    weights travel), built from a run config with `overrides`, and the learner's step: what a run's
    rollout source holds. `sampler(...)` / `sample(...)` sample as a run does; `step(model)` moves the
    weights as an optimizer step does; `mode`: the servers' log-prob mode."""

    def __init__(self, tok, run_dir: str, model, *overrides, quant=None):
        cfg = config.load(None, [f'train.output_dir="{run_dir}"', 'rollout.backend="vllm"', *overrides])
        self.tok, self.run_dir, self.quant, self.overrides = tok, run_dir, quant or QuantConfig(), overrides
        self.sampling = build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=cfg.train.seed,
                                      tokenizer=tok, eos=[tok.eos_token_id], run_dir=run_dir, model=model,
                                      dp=DataParallel())
        self.backend, self.weights = self.sampling.backend, self.sampling.weights
        self.mode = logprobs_mode(cfg.rollout.top_p, cfg.rollout.top_k)
        self.version = 0  # the learner's step that made the current weights

    @property
    def pool(self):
        return self.weights.pool

    @property
    def servers(self):
        return [m.server for m in self.pool.alive()]

    def publish(self, model) -> None:
        """`model`'s weights published now, whatever the servers held (another test's, say)."""
        self.weights.seen = None
        with torch.no_grad():
            self.weights.sync(model, self.version)

    def sampler(self, prompts, G=4, max_new=12, cfg=None):
        cfg = cfg or SamplingParams(max_new_tokens=max_new)
        return CompletionSampler(cfg, G, self.tok, [self.tok.eos_token_id], False, prompts, ["" for _ in prompts],
                                 self.backend)

    def sample(self, s, model, rows, indices, gens):
        """`s`'s samples as a run's rollout source takes them: in the policy view, the weights synced
        first (published if they changed; QaRL's alignment at the first sync)."""
        source = Source(s, self.sampling, [], None, DataParallel(0), model, self.quant)
        source.at_step(self.version)
        return source.sample(s, rows, indices, gens).samples

    def step(self, model, scale=0.05, only=None) -> None:
        """What a trainer's step does to the weights, in place as AdamW writes them (`only`: the
        parameters whose names hold it), seeded by the step (the low-bit test's share of tokens within
        1e-4 depends on the weights)."""
        g = torch.Generator().manual_seed(self.version)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if only is None or only in n:
                    p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
        self.version += 1

    def close(self) -> None:
        self.sampling.close()


def urls_of(pool, n: int = 2) -> list[str]:
    """The config lines that name the session's servers (the first n) and their key."""
    return [f"vllm.urls={pool.urls[:n]!r}".replace("'", '"'), f'vllm.api_key="{KEY}"']
