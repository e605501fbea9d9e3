"""A run's parts, built by one function (torchtitan's TrainSpec): `build(cfg, run_dir, ...)` returns `Parts`,
the typed bundle of what the trainer's step calls phase by phase. Every check that can refuse the
run's input runs here, before the run folder is touched; each part is built from its own sections of
the config (no part below this module sees the whole `RunConfig`), and what a part starts (servers,
environment workers, an agent endpoint, the asynchronous source's threads) is stopped by `closing`,
last started first, also when building fails half-way.

The order the parts are built in is the order their checks need:
  the policy      [model] (LoRA), [quant] (its low-bit forward), the engine's and the router's checks
                  of the model (rl/policy.py, backstream/stream/)
  the prompts     [data], the run's config resolved for the tokenizer (a built-in task's format)
  what samples    [rollout] + [vllm]: the backend (rl/backends/), its kind of sampler over the data
                  and the evaluation's (rl/rollout/), their longest sequence checked against it
  who scores      [reward] with what the sampler's kind brings to it (an environment's get_reward)
  who learns      [update] + [loss] + [engine] + [optim]: the reference policy, the shards, the
                  optimizer, the backward and the optimizer step (rl/update/)
  the rounds      the rollout source over the prompt stream and the collect phase (rl/rollout/)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from backstream import checkpoint
from backstream.checks import UserError
from backstream.config import RunConfig
from backstream.log import log
from backstream.metrics import Progress, check_backends
from backstream.quant.linear import quant_linears, quantize_model
from backstream.rl.backends import build_backend
from backstream.rl.backends.base import Reporter, Sampling
from backstream.rl.data.images import Pictures
from backstream.rl.data.prompts import PromptStream, encode_and_render
from backstream.rl.parallel import collectives, dataparallel
from backstream.rl.policy import eos_ids, reference_policy, tokenizer_of
from backstream.rl.rollout import build_sampler
from backstream.rl.rollout.collect import Collector
from backstream.rl.rollout.evaluate import Evaluator, NoEvaluation
from backstream.rl.rollout.sampler import Sampler
from backstream.rl.rollout.source import Source, build_source, check_backend
from backstream.rl.scoring.advantages import ZeroAdvantageWatch, format_hint
from backstream.rl.scoring.rewards import Rewards
from backstream.rl.update.backward import verify_engine
from backstream.rl.update.learner import BeforeUpdate, Learner
from backstream.rl.update.optim import Stepper
from backstream.stream.hf import base_model
from backstream.stream.router import moe_spec
from backstream.stream.vision import image_token


@dataclass(kw_only=True)
class Parts:
    """A run's parts (see the module docstring). `cfg`: the run's config as the tokenizer resolved it (a
    built-in task's format, stop and reward), what the run folder records."""

    cfg: RunConfig
    device: torch.device
    dp: dataparallel.DataParallel
    model: nn.Module
    tok: object
    saved: object  # what a checkpoint saves beside the weights: the tokenizer, or a VLM's processor
    ref: nn.Module | None
    examples: list[dict]
    sampling: Sampling
    sampler: Sampler
    evaluator: Evaluator | NoEvaluation
    rewards: Rewards
    source: Source
    collector: Collector
    advantages: Callable[[Tensor, int], Tensor]
    learner: Learner
    reporters: tuple[Reporter, ...]
    zero_adv: ZeroAdvantageWatch
    progress: Progress
    closing: contextlib.ExitStack

    def close(self) -> None:
        """Stop what the parts started, last started first."""
        self.closing.close()


def build(cfg: RunConfig, run_dir: str, *, model=None, tokenizer=None, sampling: Sampling | None = None) -> Parts:
    """The parts of the run `cfg` in `run_dir` (see the module docstring): `model`/`tokenizer` objects to
    train instead of loading model.name (LoRA and the dtype of [model] still applied); `sampling`: what
    samples instead of the backend rollout.backend names (rl/backends/base.py `Sampling`)."""
    tc = cfg.train
    torch.manual_seed(tc.seed)
    device = cfg.model.torch_device()
    cfg.validate(world_size=collectives.requested_world())  # None in a plain process
    check_backends(tc.log_tensorboard, tc.log_wandb)
    dp = dataparallel.start(cfg.distributed, device=device, seed=tc.seed, minibatches=cfg.update.minibatches,
                        reuse_kv=cfg.engine.reuse_rollout_kv)
    images = cfg.data.holds_images() or ((cfg.env.enabled or cfg.env.program) and cfg.env.images)
    if images:
        check_images(cfg)
    policy, tok = build_policy(cfg, model, tokenizer, images)
    processor, tok = (tok, tokenizer_of(tok)) if images else (None, tok)
    cfg = cfg.for_tokenizer(processor or tok)  # a built-in task through a chat model's template
    cfg = cfg.with_run_defaults()  # L_max and lr (the trainer states them before a resume's check)
    examples = cfg.data.build(tc.seed, prompt_optional=bool(cfg.env.factory or cfg.env.program))
    closing = contextlib.ExitStack()
    with contextlib.ExitStack() as failing:  # what started is stopped if a later part refuses the run
        failing.callback(closing.close)
        parts = _build(cfg, run_dir, dp, device, policy, tok, processor, examples, sampling, closing,
                       copy_of_given=model is not None)
        failing.pop_all()
    return parts


def check_images(cfg: RunConfig) -> None:
    """What a run with images in its prompts cannot do yet (docs/vision.md), refused by name before
    anything starts."""
    episodes = (cfg.env.enabled or cfg.env.program) and cfg.env.images
    refused = {"rollout.backend = \"vllm\" (a prompt's images go to the servers; an episode's do not yet)":
               cfg.rollout.backend == "vllm" and episodes,
               "engine.reuse_rollout_kv = true": cfg.engine.reuse_rollout_kv,
               "[distributed] (torchrun)": collectives.requested_world() not in (None, 1)}
    for what, on in refused.items():
        if on:
            raise UserError(f"data: the prompts (or env.images' episodes) hold images, and images are not yet "
                            f"supported with {what}; sample with rollout.backend = \"local\" in one process "
                            "(docs/vision.md)")


def build_policy(cfg: RunConfig, model=None, tokenizer=None, images: bool = False):
    """The policy ([model]: LoRA; [quant]: its low-bit forward), and the checks it must pass before
    anything is written (the router's for loss.router_aux_coef, the engine's, engine.verify's);
    `images`: the data holds images (a VLM, loaded with its processor as the second value)."""
    model, tok = cfg.model.build(model, tokenizer, images=images)
    if images:
        log.info(f"model: {type(base_model(model)).__name__} (image-text), vision tower "
                 f"{'frozen' if cfg.model.freeze_vision else 'trained'}")
    if cfg.quant.enabled:  # after LoRA: the base layers are quantized, the adapters stay in full precision
        quantize_model(model, cfg.quant)
    if cfg.loss.router_aux_coef > 0:
        moe_spec(model, "loss.router_aux_coef")
    cfg.engine.check_model(model)
    if cfg.engine.verify and cfg.engine.streamed:
        verify_engine(model)
    return model, tok


def _build(cfg: RunConfig, run_dir: str, dp, device, model, tok, processor, examples: list[dict],
           sampling: Sampling | None, closing: contextlib.ExitStack, copy_of_given: bool) -> Parts:
    tc, ro = cfg.train, cfg.rollout
    eos, quantized = eos_ids(model, tok), list(quant_linears(model).values())  # (before sharding)
    sampling = sampling or build_backend(ro, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=tc.seed,
                                         tokenizer=tok, eos=eos, run_dir=run_dir, model=model, dp=dp,
                                         processor=processor)
    closing.enter_context(sampling.closing)
    check_backend(ro, sampling.backend)
    progress = Progress(enabled=tc.progress and dp.main, total_steps=tc.steps)
    context = getattr(model.config, "max_position_embeddings", None)
    samplers: list[Sampler] = []
    image_id = image_token(model) if processor is not None else None
    vision = None if processor is None else Pictures(processor, image_id, base_model(model).config)

    def sampler_for(rows: list[dict], k: int, return_kv: bool = False):
        """The run's kind of sampler over `rows` (the training data, or the evaluation's), k samples per
        prompt; a prompt whose completion could run past the model's context is an error now."""
        prompts, text, pictures = encode_and_render(rows, tok, cfg.data.max_prompt_tokens, ro.max_new_tokens,
                                                    context, processor, cfg.data.folder(), image_id)
        sampler, environment = build_sampler(cfg.env, ro.sampling(), k, tokenizer=tok, eos=eos, context=context,
                                             backend=sampling.backend, examples=rows, prompts=prompts,
                                             prompt_text=text, return_kv=return_kv, closing=closing,
                                             pictures=pictures, vision=vision)
        samplers.append(sampler)
        return sampler, environment

    sampler, environment = sampler_for(examples, ro.group_size, cfg.engine.reuse_rollout_kv)
    rewards = Rewards(cfg.reward, environment=environment)
    evaluator = Evaluator.build(cfg.eval, cfg.data, tc.seed, lambda rows, k: sampler_for(rows, k)[0])
    for check in sampling.preflight:  # every sampler built: what they sample must fit (a server's context)
        for s in samplers:
            if s.needs is not None:
                check.need_context(*s.needs)
        check.check(model)
    ref = reference_policy(cfg.update.kl_reference, cfg.model, cfg.quant, model, copy_of_given)  # before sharding
    dp.prepare(model, ref)  # after LoRA and quantization; the optimizer then holds the shards
    opt, sched = cfg.optim.build(model.parameters())
    stepper = Stepper(cfg.optim, model, opt, sched, quantized, last_checkpoint=lambda: checkpoint.latest(run_dir))
    before = BeforeUpdate(cfg.update, cfg.engine.reuse_rollout_kv)  # where π_old and π_ref come from
    learner = Learner(cfg.update, cfg.loss, cfg.engine.build(device), before, stepper, model, ref, dp,
                      aligned=cfg.quant.aligned, max_staleness=ro.max_staleness, phase=progress.phase)
    stream = PromptStream(len(examples), tc.seed)
    source = build_source(ro, sampler, sampling, examples, stream, dp, model, cfg.quant, per_step=tc.prompts_per_step,
                          servers_here=ro.backend == "vllm" and not cfg.vllm.addresses(), phase=progress.phase)
    ahead = (source,) if ro.max_staleness else ()  # the asynchronous source: its threads, its idle time
    for s in ahead:
        closing.callback(s.close)
    collector = Collector(ro, cfg.reward, tc.prompts_per_step, tc.steps, source, sampler, rewards, examples, dp, tok,
                          sampling.resting)
    return Parts(cfg=cfg, device=device, dp=dp, model=model, tok=tok, saved=processor or tok, ref=ref,
                 examples=examples, sampling=sampling,
                 sampler=sampler, evaluator=evaluator, rewards=rewards, source=source, collector=collector,
                 advantages=cfg.algorithm.advantages, learner=learner,
                 reporters=(sampler, *sampling.reporters, *ahead),
                 zero_adv=ZeroAdvantageWatch(format_hint(tok, cfg.data.format, cfg.reward.functions)),
                 progress=progress, closing=closing)
