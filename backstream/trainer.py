"""The RL loop: prompts → rollouts → rewards → advantages → streamed backward → optimizer step.

One step:
  1. take `prompts_per_step` prompts; sample G completions each (in-process sampler, one prefill
     per prompt);
  2. score them (reward functions, TRL signature); overlong filter/penalty; group advantages;
     DAPO dynamic sampling refills the batch when groups have no signal;
  3. for each epoch and minibatch (group-aligned): build the objective (normalisers over the whole
     minibatch, before any block), run the exact streamed backward (or the naive reference, for
     comparison), clip, step. Log-probs of the policy before the update come from the engine's
     prefill when there is a single update per rollout, else from one no-grad pass up front.
Simplified on purpose: one process (no data parallelism yet); rollout and learner share weights.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import signal
import time

import torch

from backstream import checkpoint, config as cfgmod, data as datamod
from backstream.engine import logprobs as engine_logprobs, stream_backward
from backstream.losses import build_objective, drgrpo_advantages, grpo_advantages, rloo_advantages
from backstream.metrics import Logger, check_backends
from backstream.reference import reference_backward
from backstream.router import moe_spec
from backstream.rewards import Rewards
from backstream.rollout import Rollout, generate

ADVANTAGES = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# -- set-up --------------------------------------------------------------------------------------


def load_model(mc: cfgmod.ModelConfig, device: torch.device):
    dtype = DTYPES[mc.dtype]
    if mc.name == "default":
        from backstream.default_model import load_default  # noqa: PLC0415

        model, tok = load_default(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        try:
            tok = AutoTokenizer.from_pretrained(mc.name)
            model = AutoModelForCausalLM.from_pretrained(mc.name, dtype=dtype)
        except OSError as e:
            raise ValueError(f"model.name: cannot load {mc.name!r} ({e})") from None
    return apply_lora(model.to(device).eval(), mc), tok


def apply_lora(model, mc: cfgmod.ModelConfig):
    if mc.lora_r == 0:
        return model
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    return get_peft_model(model, LoraConfig(r=mc.lora_r, lora_alpha=mc.lora_alpha, target_modules=mc.lora_targets))


_VERIFIED: dict = {}  # architecture → VerifyReport: a process checks each architecture once


def verify_engine(model) -> None:
    """engine.verify: the streamed backward must be exact on a miniature of `model`'s architecture
    (same config, same LoRA config, same train/eval mode; `backstream.verify`), else stop before
    the run folder is written."""
    from backstream.verify import verify  # noqa: PLC0415

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    peft = getattr(model, "peft_config", None)
    # what saving a checkpoint writes into the config (architectures, dtype) is not architecture
    arch = {k: v for k, v in base.config.to_dict().items()
            if k not in ("architectures", "dtype", "_name_or_path", "transformers_version")}
    key = (json.dumps(arch, sort_keys=True, default=str), repr(peft), model.training)
    report = _VERIFIED.get(key)
    if report is None:
        report = _VERIFIED[key] = verify(model)
    if not report.ok:
        detail = f"{report.verdict} ({report.reason})" if report.kind == "wrong" else report.verdict
        raise ValueError(f"engine.verify: the streamed backward is not exact on a miniature of this model's architecture "
                         f"({report.model_type}): {detail}. `backstream verify` prints the details; set "
                         "engine.backward = \"reference\" to train with the naive backward, or engine.verify = false "
                         "to skip this check")


def make_optimizer(oc: cfgmod.OptimConfig, params):
    params = [p for p in params if p.requires_grad]
    if oc.name == "adamw":
        opt = torch.optim.AdamW(params, lr=oc.lr, betas=tuple(oc.betas), weight_decay=oc.weight_decay)
    elif oc.name == "rmsprop":
        opt = torch.optim.RMSprop(params, lr=oc.lr, weight_decay=oc.weight_decay)
    else:
        if not hasattr(torch.optim, "Muon"):
            raise ValueError("optim.name: 'muon' needs a torch with torch.optim.Muon; use adamw or rmsprop")
        bad = [tuple(p.shape) for p in params if p.dim() != 2]
        if bad:
            raise ValueError(f"optim.name: Muon optimizes 2-D weights only, and {len(bad)} trainable tensors are not 2-D "
                             f"(e.g. {bad[0]}); use LoRA (model.lora_r > 0) or adamw")
        opt = torch.optim.Muon(params, lr=oc.lr, weight_decay=oc.weight_decay)
    warm = oc.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
    return opt, sched


def load_data(dc: cfgmod.DataConfig, seed: int) -> tuple[list[dict], str]:
    if dc.path:
        examples, source = datamod.load_examples(dc.path), dc.path
    else:
        from backstream.tasks import make_dataset  # noqa: PLC0415

        examples, source = make_dataset(dc.task, dc.num_examples, seed), f"task {dc.task}"
    datamod.check_examples(examples, source)
    return examples, source


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device: 'cuda' asked for but no GPU is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- one step's pieces ---------------------------------------------------------------------------


def overlong_shaping(rollout: Rollout, rewards: torch.Tensor, ac: cfgmod.AlgorithmConfig, max_new: int):
    """DAPO overlong handling. filter: truncated samples get no loss; penalty: a linear penalty over
    the last `overlong_buffer` tokens before max_new_tokens, −1 at the limit."""
    keep = torch.ones(len(rewards), dtype=torch.bool)
    if ac.overlong == "filter":
        keep = torch.tensor([r != "length" for r in rollout.finish_reason])
    elif ac.overlong == "penalty":
        lens = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
        start = max_new - ac.overlong_buffer
        rewards = rewards + torch.clamp((start - lens) / max(ac.overlong_buffer, 1), min=-1.0, max=0.0)
    return rewards, keep


def select_groups(rollout: Rollout, idx: list[int]) -> Rollout:
    """Keep whole groups (indices of groups)."""
    G = rollout.group_size
    rows = [g * G + j for g in idx for j in range(G)]
    pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
    return Rollout(prompt_index=pick(rollout.prompt_index), prompt_ids=pick(rollout.prompt_ids),
                   completion_ids=pick(rollout.completion_ids), logprobs=pick(rollout.logprobs),
                   finish_reason=pick(rollout.finish_reason), kv=pick(rollout.kv) if rollout.kv else None,
                   group_size=G)


def concat(a: Rollout | None, b: Rollout) -> Rollout:
    if a is None:
        return b
    return Rollout(prompt_index=a.prompt_index + b.prompt_index, prompt_ids=a.prompt_ids + b.prompt_ids,
                   completion_ids=a.completion_ids + b.completion_ids, logprobs=a.logprobs + b.logprobs,
                   finish_reason=a.finish_reason + b.finish_reason,
                   kv=(a.kv + b.kv) if a.kv is not None and b.kv is not None else None, group_size=a.group_size)


class Trainer:
    def __init__(self, cfg: cfgmod.RunConfig, run_dir: str | None = None, resume: bool = False,
                 model=None, tokenizer=None):
        """`model`/`tokenizer`: objects to train instead of loading `cfg.model.name` (LoRA and the
        dtype from `cfg.model` are still applied to it)."""
        self.cfg = cfg
        tc, ac = cfg.train, cfg.algorithm
        torch.manual_seed(tc.seed)
        self.device = _device(cfg.model.device)
        # everything that can fail on bad input is checked before the run folder is touched
        if cfg.engine.reuse_rollout_kv and ac.epochs * ac.minibatches != 1:
            raise ValueError("engine.reuse_rollout_kv: the rollout's K/V are stale after the first optimizer step; "
                             "it needs algorithm.epochs = algorithm.minibatches = 1")
        check_backends(tc.log_tensorboard, tc.log_wandb)
        if cfg.loss.router_aux_coef > 0 and cfg.engine.reuse_rollout_kv:
            raise ValueError("loss.router_aux_coef > 0 needs the prefill's routing counts; set engine.reuse_rollout_kv = false")
        if getattr(cfg.loss, "kl_coef", 0.0) > 0 and not ac.kl_reference:
            raise ValueError("loss.kl_coef > 0 needs algorithm.kl_reference = true (a frozen reference policy)")
        t_loss = getattr(cfg.loss, "temperature", 1.0)
        if cfg.rollout.temperature > 0 and t_loss != cfg.rollout.temperature:
            raise ValueError(f"loss.temperature: got {t_loss}, but rollout.temperature is {cfg.rollout.temperature}; "
                             "the learner must score tokens at the sampling temperature (set both the same)")
        G = cfg.rollout.group_size
        if G < 2 and ac.advantage in ("grpo", "drgrpo", "rloo"):
            raise ValueError(f"rollout.group_size: got {G}; group advantages ({ac.advantage}) need at least 2 samples per prompt")
        if tc.prompts_per_step % ac.minibatches:
            raise ValueError(f"algorithm.minibatches: {ac.minibatches} does not divide train.prompts_per_step={tc.prompts_per_step}")
        if model is None:
            self.model, self.tok = load_model(cfg.model, self.device)
        else:
            if tokenizer is None:
                raise ValueError("tokenizer: required when a model object is passed")
            self.model, self.tok = apply_lora(model.to(self.device, DTYPES[cfg.model.dtype]).eval(), cfg.model), tokenizer
        if cfg.loss.router_aux_coef > 0:
            moe_spec(self.model, "loss.router_aux_coef")
        if cfg.engine.verify and cfg.engine.backward == "stream":
            verify_engine(self.model)
        self.examples, source = load_data(cfg.data, tc.seed)
        self.prompts = datamod.encode_prompts(self.examples, self.tok, cfg.data.max_prompt_tokens)
        self.prompt_text = [datamod.render_prompt(e["prompt"], self.tok) for e in self.examples]
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in self.prompts)
        if ctx is not None and longest + cfg.rollout.max_new_tokens > ctx:
            raise ValueError(f"data: the longest prompt ({longest} tokens) + rollout.max_new_tokens "
                             f"({cfg.rollout.max_new_tokens}) exceeds the model's context ({ctx} positions)")
        self.rewards = Rewards(cfg.reward)
        self.opt, self.sched = make_optimizer(cfg.optim, self.model.parameters())
        self.ref = None
        if ac.kl_reference and cfg.model.lora_r == 0:  # (with LoRA the base model is the reference)
            if model is not None:
                self.ref = copy.deepcopy(self.model)  # before any update: the initial policy
            else:
                self.ref, _ = load_model(dataclass_replace(cfg.model, lora_r=0), self.device)
            self.ref.requires_grad_(False)
        self.stream = datamod.PromptStream(len(self.examples), tc.seed)
        self.gen = torch.Generator().manual_seed(tc.seed)
        self.step = 0
        self.run_dir = run_dir or tc.output_dir
        self.eos = self.tok.eos_token_id
        if resume:
            self._resume()
        else:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "config.toml"), "w") as f:
                f.write(to_toml(cfg.to_dict()))
        self.logger = Logger(self.run_dir, progress=tc.progress, tensorboard=tc.log_tensorboard, wandb=tc.log_wandb,
                             config=cfg.to_dict(), total_steps=tc.steps, append=resume, wandb_project=tc.wandb_project,
                             start_step=self.step)
        self._stop = False

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"step": self.step, "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "rng": checkpoint.rng_state(self.gen), "data_position": self.stream.position}

    def save(self) -> str:
        return checkpoint.save(self.run_dir, self.step, self.model, self.tok, self.state(), self.cfg.train.keep_checkpoints)

    def _resume(self) -> None:
        path = checkpoint.latest(self.run_dir)
        if path is None:
            raise ValueError(f"--resume: {self.run_dir} holds no complete checkpoint")
        from safetensors.torch import load_file  # noqa: PLC0415

        if self.cfg.model.lora_r > 0:
            from peft import set_peft_model_state_dict  # noqa: PLC0415

            set_peft_model_state_dict(self.model, load_file(os.path.join(path, "adapter_model.safetensors")))
        else:
            missing, unexpected = self.model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
            assert not unexpected, unexpected
            self.model.tie_weights()
        st = checkpoint.load_state(path)
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        checkpoint.restore_rng(st["rng"], self.gen)
        self.stream.position = st["data_position"]
        self.step = st["step"]

    # -- the loop -------------------------------------------------------------------------------
    def rollout_round(self, n_prompts: int):
        idx = self.stream.take(n_prompts)
        self.model.eval()
        r = generate(self.model, [self.prompts[i] for i in idx], self.cfg.rollout, eos_token_id=self.eos,
                     tokenizer=self.tok, generator=self.gen, return_kv=self.cfg.engine.reuse_rollout_kv)
        r.prompt_index = [idx[j] for j in r.prompt_index]
        return r

    def score(self, r: Rollout):
        texts = r.texts(self.tok)
        cols = {k: [self.examples[i][k] for i in r.prompt_index] for k in self.examples[0] if k != "prompt"}
        total, per_fn = self.rewards(texts, [self.prompt_text[i] for i in r.prompt_index], cols)
        return total, per_fn

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return ADVANTAGES[self.cfg.algorithm.advantage](rewards, self.cfg.rollout.group_size)

    def train_step(self) -> dict:
        cfg, ac = self.cfg, self.cfg.algorithm
        G, P = cfg.rollout.group_size, cfg.train.prompts_per_step
        t0 = time.perf_counter()
        times = {"rollout": 0.0, "reward": 0.0, "prefill": 0.0, "backward": 0.0, "optim": 0.0}
        batch, rewards, keep, per_fn_all = None, [], [], {}
        raw_rewards = []
        for attempt in range(1 + (ac.max_refills if ac.dynamic_sampling else 0)):
            need = P - (len(batch) // G if batch else 0)
            if need <= 0:
                break
            t = time.perf_counter()
            r = self.rollout_round(need)
            times["rollout"] += time.perf_counter() - t
            t = time.perf_counter()
            total, per_fn = self.score(r)
            times["reward"] += time.perf_counter() - t
            raw_rewards.append(total)
            for k, v in per_fn.items():
                per_fn_all.setdefault(k, []).append(v)
            total, kp = overlong_shaping(r, total, ac, cfg.rollout.max_new_tokens)
            if ac.dynamic_sampling:
                groups = [g for g in range(need) if total[g * G:(g + 1) * G].std() > 0 and attempt < ac.max_refills]
                if attempt == ac.max_refills:  # out of refills: keep what the last round gave
                    groups = list(range(need))
                r = select_groups(r, groups)
                sel = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
                total, kp = total[sel], kp[sel]
            batch = concat(batch, r)
            rewards.append(total)
            keep.append(kp)
        rewards, keep = torch.cat(rewards), torch.cat(keep)
        adv = self.advantages(rewards) * keep
        seqs, mask, sampler_lp = batch.sequences(), batch.completion_mask(), batch.aligned_logprobs()
        n_groups = len(batch) // G
        metrics = {"step": self.step + 1, "reward/mean": float(torch.cat(raw_rewards).mean()),
                   "reward/std": float(torch.cat(raw_rewards).std()) if len(torch.cat(raw_rewards)) > 1 else 0.0,
                   "response_length/mean": float(sum(len(c) for c in batch.completion_ids) / len(batch)),
                   "batch/groups": n_groups, "batch/zero_adv_frac": float((adv == 0).float().mean())}
        for k, v in per_fn_all.items():
            metrics[f"reward/{k}"] = float(torch.cat(v).mean())
        # log-probs before the update: from the engine's prefill when there is a single update
        single = ac.epochs * ac.minibatches == 1
        old = None
        if cfg.engine.reuse_rollout_kv:  # no prefill: the sampler's log-probs are those of π_old
            old = sampler_lp
        elif not single:
            t = time.perf_counter()
            old = self._logprobs(self.model, seqs, mask)
            times["prefill"] += time.perf_counter() - t
        ref = None
        if ac.kl_reference:
            t = time.perf_counter()
            ref = self._ref_logprobs(seqs, mask)
            times["prefill"] += time.perf_counter() - t
        per_mb = n_groups // ac.minibatches if n_groups >= ac.minibatches else n_groups
        loss_metrics, mismatch = {}, []
        for epoch in range(ac.epochs):
            for mb in range(max(1, math.ceil(n_groups / max(per_mb, 1)))):
                rows = list(range(mb * per_mb * G, min(n_groups, (mb + 1) * per_mb) * G))
                if not rows:
                    continue
                s_mb = [seqs[i] for i in rows]
                obj = build_objective(cfg.loss, sequences=s_mb, completion_mask=[mask[i] for i in rows],
                                      advantages=adv[rows], old_logprobs=None if old is None else [old[i] for i in rows],
                                      ref_logprobs=None if ref is None else [ref[i] for i in rows])
                self.model.train(False)  # no dropout: the backward must be that of the sampled policy
                if cfg.engine.backward == "stream":
                    kw = {}
                    if cfg.engine.block_size:
                        kw["block_size"] = cfg.engine.block_size
                    if cfg.engine.memory_budget_mb:
                        kw["memory_budget"] = cfg.engine.memory_budget_mb * 2**20
                    if cfg.engine.reuse_rollout_kv:
                        kw["kv"] = [batch.kv[i] for i in rows]
                    res = stream_backward(self.model, s_mb, objective=obj, **kw)
                    times["prefill"] += res.stats.prefill_s
                    times["backward"] += res.stats.backward_s
                else:
                    t = time.perf_counter()
                    res = reference_backward(self.model, s_mb, objective=obj)
                    times["backward"] += time.perf_counter() - t
                if epoch == 0:  # sampler/learner agreement on the tokens the learner computed
                    for j, i in enumerate(rows):
                        d = (res.logprobs[j].double() - sampler_lp[i].double())[mask[i]]
                        d = d[~torch.isnan(d)]
                        if len(d):
                            mismatch.append(d.abs().mean())
                t = time.perf_counter()
                gn = self._optimizer_step()
                times["optim"] += time.perf_counter() - t
                for k, v in obj.metrics().items():
                    loss_metrics.setdefault(k, []).append(v)
                if res.stats.router_aux_loss is not None:
                    loss_metrics.setdefault("router_aux", []).append(res.stats.router_aux_loss)
                loss_metrics.setdefault("grad_norm", []).append(gn)
        for k, v in loss_metrics.items():
            metrics[f"loss/{k}" if k != "grad_norm" else "optim/grad_norm"] = float(sum(v) / len(v))
        if mismatch:
            metrics["mismatch/logprob_abs"] = float(torch.stack(mismatch).mean())
        self.step += 1
        step_time = time.perf_counter() - t0
        tokens = sum(len(s) for s in seqs)
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics.update({"time/step": step_time, "throughput/tokens_per_s": tokens / step_time,
                        "optim/lr": self.sched.get_last_lr()[0], "memory/peak_mib": peak_mib(self.device)})
        return metrics

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        mx = self.cfg.optim.max_grad_norm
        if mx > 0:
            gn = float(torch.nn.utils.clip_grad_norm_(params, mx))
        else:
            gn = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return gn

    def _logprobs(self, model, seqs, mask):
        if self.cfg.engine.backward == "stream":
            return engine_logprobs(model, seqs, mask)
        # the reference engine's old log-probs: plain full-sequence forwards
        out = []
        with torch.no_grad():
            for s, m in zip(seqs, mask):
                logits = model(input_ids=s[None].to(self.device)).logits[0, :-1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                lp = torch.full((len(s),), math.nan, dtype=logits.dtype)
                lp[1:] = torch.log_softmax(logits, -1).gather(-1, s[1:, None].to(self.device))[:, 0].cpu()
                lp[~m] = math.nan
                out.append(lp)
        return out

    def _ref_logprobs(self, seqs, mask):
        if self.ref is not None:
            return self._logprobs(self.ref, seqs, mask)
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(self.model, seqs, mask)

    def _signal(self, signum, frame):
        self._stop = True

    def run(self) -> str:
        tc = self.cfg.train
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.step < tc.steps and not self._stop:
                m = self.train_step()
                self.logger.log(m)
                if tc.save_every and self.step % tc.save_every == 0:
                    self.save()
            self.save()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.logger.close()
        return self.run_dir


def dataclass_replace(dc, **kw):
    new = copy.copy(dc)
    for k, v in kw.items():
        setattr(new, k, v)
    return new


def to_toml(d: dict) -> str:
    """The resolved config as TOML (flat sections of scalars and lists)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {val(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def train(config: cfgmod.RunConfig | str | None = None, overrides: list[str] = (), resume: str | None = None,
          model=None, tokenizer=None) -> str:
    """Run a training job; returns the run folder. `config` is a RunConfig, a TOML path or None
    (defaults); `resume` a run folder to continue; `model`/`tokenizer` objects to train instead of
    loading `model.name`."""
    if resume:
        path = os.path.join(resume, "config.toml")
        if not os.path.exists(path):
            raise ValueError(f"--resume: {resume} is not a run folder (no config.toml)")
        cfg = cfgmod.load(path, overrides)
        return Trainer(cfg, run_dir=resume, resume=True, model=model, tokenizer=tokenizer).run()
    cfg = config if isinstance(config, cfgmod.RunConfig) else cfgmod.load(config, overrides)
    return Trainer(cfg, model=model, tokenizer=tokenizer).run()
