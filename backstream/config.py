"""Run configuration: one TOML file plus `--set section.key=value` overrides.

Each component owns a small `@dataclass(kw_only=True)` beside its code, documented field by field
(attribute docstrings) and validated in `__post_init__`; this module maps TOML sections onto them,
checks names and types with errors that name the key, the value and the allowed values, and renders
`backstream train --help` from the same docstrings. The resolved config is saved with the run.
The sections and where they live: model, data, rollout, env, reward, loss (one type per variant,
picked by its `type` key), optim, engine and distributed (only what torchrun's environment does not
say) in backstream/rl/; quant in backstream/quant/; the trainer's own algorithm and train below.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from backstream.checks import UserError, at_least, choice
from backstream.log import log
from backstream.quant.linear import QuantConfig
from backstream.rl.agent.env import EnvConfig
from backstream.rl.backends.vllm.server import VLLMConfig
from backstream.rl.data.prompts import DataConfig
from backstream.rl.parallel.dataparallel import DistributedConfig
from backstream.rl.policy import ModelConfig
from backstream.rl.rollout.evaluate import EvalConfig
from backstream.rl.rollout.source import RolloutConfig
from backstream.rl.scoring.advantages import AlgorithmConfig
from backstream.rl.scoring.rewards import RewardConfig
from backstream.rl.update.backward import EngineConfig
from backstream.rl.update.learner import UpdateConfig
from backstream.rl.update.losses import LOSS_TYPES, LossConfig, PPOClipConfig
from backstream.rl.update.optim import ADAPTER_LR, DEFAULT_MODEL_LR, PRETRAINED_LR, OptimConfig
from backstream.usercode import absolute_spec, is_path_spec, spec_files

SUM_NORM = "seq-mean-token-sum-norm"  # Dr.GRPO's aggregation, whose L_max a run states (loss.max_len_norm)
BASE_MODEL_SHOTS = 3  # data.shots for a base model: lm-evaluation-harness's few-shot prompts, for the same reason


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 40
    """RL steps: one rollout batch each (and epochs × minibatches optimizer steps)."""
    prompts_per_step: int = 8
    """Prompts sampled per step (each gets rollout.group_size completions). Under torchrun, the global
    number: each rank samples and trains an equal share of whole groups, so it must divide by the world
    size × update.minibatches."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    output_dir: str = "runs/demo"
    """Run folder: config, metrics.jsonl, checkpoints, plots."""
    save_every: int = 0
    """Also checkpoint every N steps (0: no step interval)."""
    save_every_minutes: float = 10.0
    """Checkpoint when this many minutes passed since the last checkpoint, so that a kill loses at most
    about that much work; with it (or save_every) on, step 1 is checkpointed too (a run is resumable at
    once, and a checkpoint path that cannot be written fails at once). 0 with save_every = 0: only at
    the end and on SIGINT/SIGTERM. Checkpoints are also written at the end and on SIGINT/SIGTERM."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run folder (oldest deleted first): the disk a run takes is bounded."""
    log_tensorboard: bool = False
    """Also log to TensorBoard, in RUN_DIR/tensorboard (needs the tensorboard package)."""
    log_wandb: bool = False
    """Also log to Weights & Biases (needs wandb; WANDB_MODE=offline works without an account).
    A resumed run continues the same W&B run."""
    wandb_project: str = "backstream"
    """W&B project name."""
    progress: bool = True
    """Progress on stderr: a redrawing bar on a terminal, one line per step otherwise."""
    log_episodes: int = 0
    """Write the first N samples of each step, whole, to RUN_DIR/episodes.jsonl: prompt, messages, the
    tokens in runs of sampled / inserted, rewards per function, finish reason, episode counts and the
    reward functions' log_extra columns (TRL's log_completions). 0 = none."""
    plots: bool = True
    """Write the PNG curves (reward per function with its spread, length, KL, entropy, clipping,
    mismatch) into the run folder at each checkpoint and at the end (needs matplotlib: the plot extra)."""

    def __post_init__(self):
        at_least("train.steps", self.steps, 1)
        at_least("train.prompts_per_step", self.prompts_per_step, 1)
        at_least("train.save_every", self.save_every, 0)
        if not (isinstance(self.save_every_minutes, (int, float)) and 0 <= self.save_every_minutes < float("inf")):
            raise UserError(f"train.save_every_minutes: got {self.save_every_minutes!r}, expected a number >= 0 "
                             "(0: no time interval)")
        at_least("train.keep_checkpoints", self.keep_checkpoints, 1)
        at_least("train.log_episodes", self.log_episodes, 0)

    @property
    def periodic_checkpoints(self) -> bool:
        return self.save_every > 0 or self.save_every_minutes > 0


LOSSES = LOSS_TYPES  # [loss] is the variant its `type` key names (the registry of backstream.rl.update.losses)
# sections whose class is a variant picked by one of their keys: section → (key, registry, default)
VARIANTS: dict[str, tuple[str, dict[str, type], str]] = {"loss": ("type", LOSSES, "ppo_clip")}


def variants(section: str) -> list[type]:
    """The classes a section may be: its variants, or its one class."""
    return list(VARIANTS[section][1].values()) if section in VARIANTS else [SECTIONS[section]]


def section_class(section: str, values: dict) -> type:
    """The class of a section's table: the variant its key names, or the section's one class."""
    if section not in VARIANTS:
        return SECTIONS[section]
    key, registry, default = VARIANTS[section]
    kind = values.get(key, default)
    choice(f"{section}.{key}", kind, list(registry))
    return registry[kind]

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "env": EnvConfig, "reward": RewardConfig,
    "algorithm": AlgorithmConfig, "update": UpdateConfig, "loss": PPOClipConfig, "optim": OptimConfig,
    "engine": EngineConfig,
    "train": TrainConfig, "eval": EvalConfig, "quant": QuantConfig, "distributed": DistributedConfig,
    "vllm": VLLMConfig,
}


@dataclass
class RunConfig:
    """One run: a config per section, each validated when built. The keys that constrain each other
    across sections are checked by `validate()`, which the trainer calls before it touches anything:
    not when the config is built, so that one can be loaded and then edited in Python (set the
    rollout's temperature, then the loss's) before it is run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    loss: LossConfig = field(default_factory=lambda: section_class("loss", {})())
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def public_dict(self) -> dict:
        """`to_dict` with the secrets (`SECRETS`) left empty: what the run folder and the loggers keep."""
        d = self.to_dict()
        for key in SECRETS:
            section, name = key.split(".")
            d[section][name] = ""
        return d

    def flat(self) -> dict[str, Any]:
        """{"section.key": value} of every key."""
        return {f"{sec}.{k}": v for sec, values in self.to_dict().items() for k, v in values.items()}

    def with_absolute_paths(self) -> RunConfig:
        """A copy whose file paths are absolute (relative ones resolved against the current directory):
        the run folder's config.toml then names the same files wherever the run is resumed from."""
        data = dataclasses.replace(self.data, path=os.path.abspath(self.data.path)) if self.data.path else self.data
        model = (dataclasses.replace(self.model, name=os.path.abspath(self.model.name))
                 if self.model.name != "default" and os.path.isdir(self.model.name) else self.model)
        reward = dataclasses.replace(self.reward, functions=[absolute_spec(f) for f in self.reward.functions])
        env = dataclasses.replace(self.env, factory=absolute_spec(self.env.factory) if self.env.factory else "",
                                  tools=[absolute_spec(t) for t in self.env.tools],
                                  agent=absolute_spec(self.env.agent) if self.env.agent else "")
        ev = dataclasses.replace(self.eval, path=os.path.abspath(self.eval.path)) if self.eval.path else self.eval
        return dataclasses.replace(self, data=data, model=model, reward=reward, env=env, eval=ev)

    def files_read(self) -> dict[str, str]:
        """The user's files the run reads (absolute path → the key that names it): the data and the
        reward functions' source files; a run records their fingerprints and a resume checks them."""
        files = {self.data.path: "data.path"} if self.data.path and os.path.exists(self.data.path) else {}
        for key, specs in (("reward.functions", self.reward.functions), ("env.factory", [self.env.factory]),
                           ("env.tools", self.env.tools), ("env.agent", [self.env.agent])):
            for spec in filter(None, specs):
                files.update({path: key for path in spec_files(spec)})
        return files

    def _validate_vllm(self, world_size: int | None) -> None:
        """What rollout.backend = "vllm" cannot do (yet), refused by name before the run starts."""
        r, what = self.rollout, None
        if self.engine.reuse_rollout_kv:
            what = "engine.reuse_rollout_kv: the server hands no K/V (the engine runs its prefill); set it to false"
        elif (r.top_p < 1 or r.top_k > 0) and r.temperature != 1:
            what = (f"rollout.top_p / rollout.top_k at rollout.temperature = {r.temperature}: vLLM's log-probs at a "
                    "temperature are taken after the truncation (renormalised over the kept tokens), the learner's "
                    "before it, so importance weights would be off; at temperature 1 the server reports the "
                    "learner's (raw) log-probs: sample at rollout.temperature = 1, or with top_p = 1 and top_k = 0")
        elif self.quant.enabled and (world_size or 1) > 1:
            what = ("quant.rollout under torchrun: the low-bit weights are compressed from whole layers in one "
                    "process, not from FSDP shards yet; run one process, or quant.rollout = \"none\"")
        elif self.quant.enabled and self.model.lora_r > 0:
            what = ("quant.rollout with LoRA (model.lora_r > 0): the server would need the quantized base and the "
                    "adapter apart, which is not published yet; train the full model, or quant.rollout = \"none\"")
        elif self.quant.rollout == "w4a16" and self.model.dtype == "float32":
            what = ("quant.rollout = \"w4a16\" with model.dtype = \"float32\": vLLM's int4 kernels run in 16-bit "
                    "only (on CPU cpu_gemm_wna16 has no float32 path); set model.dtype = \"bfloat16\"")
        elif (world_size or 1) > 1 and not self.vllm.addresses() and \
                self.distributed.timeout_s < self.vllm.start_timeout_s:
            # the other ranks wait in a collective while rank 0 starts the server
            what = (f"distributed.timeout_s = {self.distributed.timeout_s} is shorter than vllm.start_timeout_s = "
                    f"{self.vllm.start_timeout_s}: under torchrun the other ranks wait for rank 0's server to start; "
                    "raise distributed.timeout_s or lower vllm.start_timeout_s")
        if what is not None:
            raise UserError(f"rollout.backend = \"vllm\": {what}")

    def for_tokenizer(self, tokenizer) -> RunConfig:
        """The config with what the tokenizer decides resolved (the run folder's config.toml then
        states it): a built-in task's data.format ("auto" → "chat" or "plain"), in the chat format the
        task's chat reward ("answer") where reward.functions is left at its default, and in the plain
        format the task's stop (a newline for arith and kvlookup) where rollout.stop is left empty."""
        if self.data.path:
            return self
        from backstream.rl.data.tasks import TASKS  # noqa: PLC0415  (the tasks import the rewards)

        fmt, task = self.data.resolved_format(tokenizer), TASKS[self.data.task]
        cfg = dataclasses.replace(self, data=dataclasses.replace(self.data, format=fmt, shots=self._shots(fmt)))
        if fmt == "chat" and self.reward.functions == RewardConfig().functions:
            cfg = dataclasses.replace(cfg, reward=dataclasses.replace(self.reward, functions=[task.chat_reward]))
        if fmt == "plain" and not self.rollout.stop and task.stop:  # the answer's line ends the completion
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(self.rollout, stop=list(task.stop)))
        return cfg

    def _shots(self, fmt: str) -> int:
        """data.shots, unset resolved: 3 solved examples for a base model under data.format = "auto" (one
        without a chat template that is not the shipped default model, said), else none."""
        d = self.data
        if d.shots is not None:
            return d.shots
        from backstream.rl.data.tasks import TASKS  # noqa: PLC0415

        if d.format != "auto" or fmt != "plain" or self.model.name == "default" or not TASKS[d.task].shots:
            return 0
        log.info(f"a base model without a chat template: {BASE_MODEL_SHOTS} solved examples before each prompt "
                 "(data.shots)")
        return BASE_MODEL_SHOTS

    def generation_budget(self) -> int:
        """The most sampled tokens of one trained sequence: rollout.max_new_tokens; an episode's (an
        environment's or an agent program's) env.max_turns of them, at most env.max_episode_tokens."""
        n, env = self.rollout.max_new_tokens, self.env
        if env.enabled or env.program:
            n = min(filter(None, (n * env.max_turns, env.max_episode_tokens)))
        return n

    def with_run_defaults(self) -> RunConfig:
        """The config with what it leaves to the run stated (the run folder's config.toml then holds it):
        Dr.GRPO's L_max, loss.max_len_norm unset under seq-mean-token-sum-norm, the generation budget; an
        unset optim.lr, the model's (`OptimConfig.lr`, said)."""
        cfg = self
        if getattr(cfg.loss, "aggregation", None) == SUM_NORM and cfg.loss.max_len_norm is None:
            cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, max_len_norm=cfg.generation_budget()))
        if cfg.optim.lr is None:
            if cfg.model.name == "default":
                lr = DEFAULT_MODEL_LR
            else:
                lr = ADAPTER_LR if cfg.model.lora_r > 0 else PRETRAINED_LR
                log.info(f"optim.lr: {lr:g} for a pretrained model{'s LoRA adapter' if cfg.model.lora_r > 0 else ''} "
                         f"(unset; the shipped default model's is {DEFAULT_MODEL_LR:g})")
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr))
        return cfg

    def validate(self, world_size: int | None = None) -> None:
        """Raise a ValueError naming the keys when two sections ask for things that cannot go together.
        `world_size`: the number of ranks under torchrun (1 included), None in a plain process."""
        ac, up, ec, loss = self.algorithm, self.update, self.engine, self.loss
        if ec.reuse_rollout_kv and up.epochs * up.minibatches != 1:
            raise UserError("engine.reuse_rollout_kv: the rollout's K/V are stale after the first optimizer step; "
                             "it needs update.epochs = update.minibatches = 1")
        if ec.reuse_rollout_kv and self.quant.enabled and not self.quant.aligned:
            raise UserError(f"engine.reuse_rollout_kv: the rollout's K/V come from the {self.quant.rollout} sampler "
                             "but the learner runs in full precision (quant.aligned = false), so they are not the "
                             "learner's; set quant.aligned = true or engine.reuse_rollout_kv = false")
        if loss.router_aux_coef > 0 and ec.reuse_rollout_kv:
            raise UserError("loss.router_aux_coef > 0 needs the prefill's routing counts; "
                             "set engine.reuse_rollout_kv = false")
        if self.env.program:
            self._validate_agent(world_size)
        if self.rollout.backend == "vllm":
            self._validate_vllm(world_size)
        if loss.kl_coef > 0 and not up.kl_reference:
            raise UserError("loss.kl_coef > 0 needs update.kl_reference = true (a frozen reference policy)")
        t_sample = self.rollout.temperature
        if t_sample == 0:
            raise UserError(f"rollout.temperature: 0 samples greedily, so the {self.rollout.group_size} samples of "
                             f"a prompt are the same, every group advantage (algorithm.advantage = {ac.advantage}) is "
                             "0 and nothing is learned; sample with rollout.temperature > 0 (e.g. 1.0, and the same "
                             "loss.temperature)")
        if loss.temperature != t_sample:
            raise UserError(f"loss.temperature: got {loss.temperature}, but rollout.temperature is {t_sample}; "
                             "the learner must score tokens at the sampling temperature (set both the same)")
        G = self.rollout.group_size
        if G < 2:  # every advantage estimator is a group baseline
            raise UserError(f"rollout.group_size: got {G}; group advantages ({ac.advantage}) need at least "
                             "2 samples per prompt")
        if self.train.prompts_per_step % up.minibatches:
            raise UserError(f"update.minibatches: {up.minibatches} does not divide "
                             f"train.prompts_per_step={self.train.prompts_per_step}")
        if world_size is not None:
            self._validate_distributed(world_size)

    def _validate_agent(self, world_size: int | None) -> None:
        """What an agent program's run (env.agent, env.agent_command) cannot do (yet), refused by name."""
        key = "env.agent" if self.env.agent else "env.agent_command"
        what = None
        if self.engine.reuse_rollout_kv:
            what = "engine.reuse_rollout_kv: an agent's requests hand no K/V to the engine; set it to false"
        else:
            try:
                import fastapi  # noqa: F401, PLC0415  (the endpoint's extra)
                import uvicorn  # noqa: F401, PLC0415
            except ImportError as e:
                what = f"the agent endpoint needs FastAPI and uvicorn ({e}); pip install 'backstream[agent]'"
        if what is not None:
            raise UserError(f"{key}: {what}")

    def _validate_distributed(self, world: int) -> None:
        """What torchrun with `world` ranks cannot do with this config."""
        up, P = self.update, self.train.prompts_per_step
        unit = world * up.minibatches
        if P % unit:
            raise UserError(f"train.prompts_per_step: {P} prompts per step (the global batch) do not split into "
                             f"whole prompt groups over {world} ranks x {up.minibatches} minibatch(es); set it to a "
                             f"multiple of {unit} (e.g. {max(unit, P // unit * unit)}), or start another number of "
                             "processes (torchrun --nproc_per_node x --nnodes), or change update.minibatches")


def _coerce(key: str, value, hint):
    """Check a TOML value against a field's type hint, as `typing.get_type_hints` resolves it (ints
    are accepted for floats)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, option)
            except ValueError as e:
                errors.append(str(e))
        raise UserError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key}: got {value!r}, expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (
            isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise UserError(f"{key}: got {value!r} ({type(value).__name__}), expected {hint.__name__}")
    return value


def _build(section: str, values: dict):
    if not isinstance(values, dict):
        raise UserError(f"[{section}]: expected a table of keys, got {values!r}")
    cls = section_class(section, values)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise UserError(f"{section}.{key}: unknown key; the keys of [{section}] are {sorted(names)}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(f"{section}.{k}", v, hints.get(k, Any)) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required key
        raise UserError(f"[{section}]: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' → (section, key, value); the value is read as TOML, else as a string
    (a list or table that is not valid TOML is refused with the quoting it needs)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"--set {text!r}: expected section.key=value, e.g. --set optim.lr=3e-4")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs}")["v"]
    except tomllib.TOMLDecodeError:
        if rhs.strip().startswith(("[", "{")):
            raise UserError(f"--set {text!r}: {rhs} is not a TOML value; strings inside a list need quotes, and the "
                             f"shell must leave them there: --set '{lhs}=[\"a\", \"b\"]'") from None
        value = rhs
    return section, key, value


def load(path: str | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """Read a TOML run file (or none: all defaults), apply overrides, validate every section."""
    raw: dict = dict(base or {})
    if path:
        if not os.path.isfile(path):
            raise UserError(f"config: no file {path!r} (from {os.getcwd()}); pass the TOML run file's path, or no "
                             "file for the defaults (`backstream train --help` lists every key)")
        with open(path, "rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise UserError(f"{path}: not valid TOML ({e})") from None
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    if path:
        _beside(raw, os.path.dirname(os.path.abspath(path)))
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    _renamed(raw)
    for section in raw:
        if section not in SECTIONS:
            raise UserError(f"[{section}]: unknown section; the sections are {list(SECTIONS)}")
    _task_defaults(raw)
    return RunConfig(**{s: _build(s, raw.get(s, {})) for s in SECTIONS})


RENAMED = {
    "algorithm.epochs": "update.epochs", "algorithm.minibatches": "update.minibatches",
    "algorithm.kl_reference": "update.kl_reference",
    "algorithm.dynamic_sampling": "rollout.dynamic_sampling", "algorithm.max_refills": "rollout.max_refills",
    "algorithm.overlong": "reward.overlong", "algorithm.overlong_buffer": "reward.overlong_buffer",
}
"""Keys that moved (old spelling → new): [algorithm] held the update's, the rollout's and the reward's
keys, and is now the advantage's alone. The old spelling still works, in a run file, with --set and
in the config.toml of a run folder written before (a resume), with a line that names the new key."""
MOVED_SPECS = {"backstream.rl.tasks": "backstream.rl.data.tasks",
               "backstream.rl.rewards": "backstream.rl.scoring.builtin"}
"""Modules of the package's own that a spec may name (`module:name`) and that moved: a toolcalc run folder
written before names `backstream.rl.tasks:Calculator`, a run file may name a built-in reward by its module."""
_SAID: set[str] = set()


def _renamed(raw: dict) -> None:
    """The old spellings of `RENAMED` and `MOVED_SPECS` in `raw`, moved to the new ones (said once a
    process); both spellings of one key is an error naming them."""
    for old, new in RENAMED.items():
        (osec, okey), (nsec, nkey) = old.split("."), new.split(".")
        values = raw.get(osec)
        if not isinstance(values, dict) or okey not in values:
            continue
        if isinstance(raw.get(nsec), dict) and nkey in raw[nsec]:
            raise UserError(f"{old} and {new}: both are set; {old} is {new}'s old spelling, keep {new}")
        raw.setdefault(nsec, {})[nkey] = values.pop(okey)
        if not values:
            del raw[osec]
        if old not in _SAID:
            _SAID.add(old)
            log.warning(f"config: {old} is now {new} (the old spelling still works; write {new})")
    def moved(spec):
        module, sep, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        return f"{MOVED_SPECS[module]}:{name}" if sep and module in MOVED_SPECS else spec

    for key in SPEC_KEYS:
        section, name = key.split(".")
        values = raw.get(section)
        if isinstance(values, dict) and name in values:
            v = values[name]
            values[name] = [moved(x) for x in v] if isinstance(v, list) else moved(v)


# the run-file keys that name files or folders (a spec "file.py:function" names its file)
PATH_KEYS = ("data.path", "eval.path", "model.name", "env.chat_template")
SPEC_KEYS = ("reward.functions", "env.factory", "env.tools", "env.agent")


def _beside(raw: dict, folder: str) -> None:
    """A relative path in a run file names a file beside that file when one is there
    (`examples/toolcalc_agent.toml`'s `agent = "toolcalc_agent.py:agent"`), else it is taken from the
    current directory, as a path given with --set is."""
    def fix(p: str) -> str:
        there = os.path.join(folder, p)
        return there if not os.path.isabs(p) and not os.path.exists(p) and os.path.exists(there) else p

    def fix_spec(spec):
        if not isinstance(spec, str):
            return spec
        if is_path_spec(spec):
            target, _, name = spec.rpartition(":")
            return f"{fix(target)}:{name}"
        if spec.startswith("reward_model:"):
            return "reward_model:" + fix(spec[len("reward_model:"):])
        return spec

    for key in (*PATH_KEYS, *SPEC_KEYS):
        section, name = key.split(".")
        values = raw.get(section)
        if not isinstance(values, dict) or name not in values:
            continue
        v = values[name]
        if key in PATH_KEYS:
            values[name] = fix(v) if isinstance(v, str) and v and v != "default" else v
        else:
            values[name] = [fix_spec(x) for x in v] if isinstance(v, list) else fix_spec(v)


def _task_defaults(raw: dict) -> None:
    """A built-in task's own defaults (rl/data/tasks.py `Task.defaults`: toolcalc's environment, say) for
    the keys the run file leaves unset; the resolved config.toml then states them."""
    data = raw.get("data", {})
    if data.get("path") or not isinstance(data.get("task", DataConfig().task), str):
        return
    from backstream.rl.data.tasks import TASKS  # noqa: PLC0415

    task = TASKS.get(data.get("task", DataConfig().task))
    env = raw.get("env", {}) if isinstance(raw.get("env"), dict) else {}
    program = env.get("agent") or env.get("agent_command")  # an agent program runs the task's tools itself
    for key, value in (task.defaults if task else {}).items():
        section, name = key.split(".", 1)
        if program and key in ("env.factory", "env.tools"):
            continue
        if isinstance(raw.get(section, {}), dict) and name not in raw.get(section, {}):
            raw.setdefault(section, {})[name] = value


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string right after each field), inherited ones too."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for a, b in zip(body, body[1:]):
            is_doc = isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant)
            if isinstance(a, ast.AnnAssign) and is_doc:
                docs[a.target.id] = " ".join(str(b.value.value).split())
    return docs


def describe() -> str:
    """Every section and key with its default and documentation (for `backstream train --help`)."""
    lines = []
    defaults = RunConfig()
    for section, cls in SECTIONS.items():
        for c in variants(section):
            key = VARIANTS.get(section, (None,))[0]
            lines.append(f"[{section}]" + (f"  ({key} = \"{getattr(c(), key)}\")" if key else ""))
            docs, hints = field_docs(c), typing.get_type_hints(c)
            inst = c() if key else getattr(defaults, section)
            for f in dataclasses.fields(c):
                # a choice's values as its type has them (often from the registry it names: data.task's tasks)
                choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
                value = getattr(inst, f.name)
                lines.append(f"  {f.name} = {'(unset)' if value is None else repr(value)}"
                             + (f"  (one of: {', '.join(map(str, choices))})" if len(choices) > 1 else ""))
                if f.name in docs:
                    lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)


# -- resuming a run ------------------------------------------------------------------------------

SECRETS = ("vllm.api_key",)
"""Keys no file of the run folder holds (config.toml writes them empty, config_changes.jsonl as
"<not written>") nor the loggers: a resumed run takes them from the environment ($VLLM_API_KEY) or
`--set` again."""

RESUMABLE = {
    "train.steps": "how long the run goes on",
    "train.save_every": "checkpoint cadence", "train.save_every_minutes": "checkpoint cadence",
    "train.keep_checkpoints": "checkpoint cadence",
    "train.progress": "logging", "train.plots": "logging", "train.log_tensorboard": "logging",
    "train.log_wandb": "logging", "train.wandb_project": "logging", "train.log_episodes": "logging",
    "reward.timeout_s": "a time limit", "distributed.timeout_s": "a time limit", "env.tool_timeout_s": "a time limit",
    "env.agent_timeout_s": "a time limit",
    "optim.max_nonfinite_steps": "a safety limit", "engine.verify": "a check before training",
    "model.device": "where the run continues (float-close, not bitwise)",
    **{f"eval.{f.name}": "evaluation (it changes nothing of the training)" for f in dataclasses.fields(EvalConfig)},
    # the server a vLLM run samples from: where it is and what it may take, not what it samples (the weights,
    # seeds and log-prob mode are the run's); vllm.extra_args stays the run's, as it can change the sampling
    # (--dtype, --quantization, --generation-config's default sampling parameters)
    **dict.fromkeys(["vllm.python", "vllm.url", "vllm.urls", "vllm.api_key", "vllm.servers", "vllm.devices",
                     "vllm.transfer_host"],
                    "where the servers are (they moved, more or fewer, another vLLM environment)"),
    "vllm.weights": "how the weights travel (the same weights either way)",
    "vllm.start_timeout_s": "a time limit", "vllm.request_timeout_s": "a time limit",
    "vllm.transfer_timeout_s": "a time limit",
    **dict.fromkeys(["vllm.kv_cache_gb", "vllm.max_model_len"],
                    "the server's memory (the run's sequences must fit either way)"),
    "train.output_dir": "the run folder is where --resume found it",
}
"""The keys a resume may change (`backstream train --resume RUN [run.toml] [--set ...]`): they are
applied and written to the run's config.toml, with what changed and when in config_changes.jsonl.
Any other key is the run's: the optimizer, its schedule, the data order and the sampler's state in
the checkpoint belong to it, so a change is refused rather than half-applied."""




def _as_run(cfg: RunConfig) -> RunConfig:
    """A run folder's config as its run trained: one written before 2026-12-04 states no loss.max_len_norm
    under seq-mean-token-sum-norm (which then divided by the minibatch's longest completion; a run since
    writes the generation budget there)."""
    if getattr(cfg.loss, "aggregation", None) != SUM_NORM or cfg.loss.max_len_norm is not None:
        return cfg
    return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, max_len_norm="minibatch"))


def run_config(run_dir: str) -> RunConfig:
    """The config of the run in `run_dir`, as it trained (`_as_run`)."""
    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        raise UserError(f"--resume: {run_dir} is not a run folder (no config.toml)")
    return _as_run(load(path))


DECIDED_AT_START = {"data.format": "auto", "data.shots": None, "rollout.stop": [],
                    "reward.functions": RewardConfig().functions, "loss.max_len_norm": None, "optim.lr": None}
"""Keys whose unset value the run decides when it starts and states in its config.toml: a built-in task's
format, shots, stop and reward (`RunConfig.for_tokenizer`: from the tokenizer and the model), Dr.GRPO's
L_max and the learning rate (`with_run_defaults`). A resume whose run file leaves one unset takes the run's."""


def kept_on_resume(run_dir: str, wanted: RunConfig) -> RunConfig:
    """`wanted`, a resume's config, with the `DECIDED_AT_START` keys it leaves unset the run's own (those of
    a built-in task only when `wanted` names one); Dr.GRPO's L_max "minibatch" for a run started before
    2026-12-04, said."""
    run, asked = run_config(run_dir).flat(), wanted.flat()
    keep = {k: run[k] for k, unset in DECIDED_AT_START.items() if k in asked and k in run and asked[k] == unset
            and (k in ("loss.max_len_norm", "optim.lr") or not wanted.data.path)}
    if keep.get("loss.max_len_norm") == "minibatch":
        log.warning("--resume: this run was started before loss.max_len_norm defaulted to the generation budget: "
                    "it goes on dividing seq-mean-token-sum-norm by the longest completion of each minibatch, "
                    "as it began (loss.max_len_norm = \"minibatch\"); a new run divides by the budget")
    sections: dict[str, dict] = {}
    for key, value in keep.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(wanted, **{sec: dataclasses.replace(getattr(wanted, sec), **kv)
                                          for sec, kv in sections.items()})


def resume_changes(run_dir: str, wanted: RunConfig) -> list[tuple[str, Any, Any]]:
    """What `wanted` (the config a resume asks for, paths absolute) changes in the run's own config:
    the (key, old, new) of the RESUMABLE keys; a ValueError naming every other key that differs."""
    old, new = run_config(run_dir).flat(), wanted.flat()
    changes = [(k, old.get(k), new.get(k)) for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    refused = [(k, a, b) for k, a, b in changes if k not in RESUMABLE]
    if refused:
        what = "; ".join(f"{k} = {b!r} (the run's: {a!r})" for k, a, b in refused)
        raise UserError(f"--resume: {what}. A resumed run keeps its own settings but for "
                         f"{', '.join(sorted(RESUMABLE))}; start a new run (another train.output_dir) to change "
                         f"{'this' if len(refused) == 1 else 'these'}, or drop the change")
    return changes


def to_toml(d: dict, notes: list[str] = ()) -> str:
    """The resolved config as TOML (flat sections of scalars and lists), `notes` as comments on top."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):  # JSON's escapes are TOML's basic string's (a stop string's "\n" included)
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = [f"# {n}" for n in notes] + ([""] if notes else [])
    for section, values in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {val(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
