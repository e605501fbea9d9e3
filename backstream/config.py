"""Run configuration: one TOML file plus `--set section.key=value` overrides.

Each component owns a small `@dataclass(kw_only=True)` beside its code, documented field by field
(attribute docstrings) and validated in `__post_init__`; this module maps TOML sections onto them,
checks names and types with errors that name the key, the value and the allowed values, and renders
`backstream train --help` from the same docstrings. The resolved config is saved with the run.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from backstream.losses import GSPOConfig, PPOClipConfig
from backstream.rewards import RewardConfig
from backstream.rollout import SamplingConfig


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "default"
    """"default" for the built-in tiny model (no download), or a hub id / local folder of a causal LM."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float64."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""

    def __post_init__(self):
        _choice("model.dtype", self.dtype, ["float32", "bfloat16", "float64"])
        _choice("model.device", self.device, ["auto", "cpu", "cuda"])
        _at_least("model.lora_r", self.lora_r, 0)


@dataclass(kw_only=True)
class DataConfig:
    task: str = "arith"
    """Built-in generated task (arith, kvlookup), used when `path` is empty."""
    path: str = ""
    """A JSONL file or a `datasets` folder with a `prompt` column (text or chat messages)."""
    num_examples: int = 2048
    """Examples generated for a built-in task."""
    max_prompt_tokens: int = 4096
    """Prompts longer than this are an error (no silent truncation)."""

    def __post_init__(self):
        _at_least("data.num_examples", self.num_examples, 1)
        _at_least("data.max_prompt_tokens", self.max_prompt_tokens, 1)


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage: str = "grpo"
    """Advantage estimator: grpo (group mean/std), drgrpo (group mean, no std), rloo (leave-one-out)."""
    epochs: int = 1
    """PPO epochs over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per epoch (the rollout batch is split in this many groups-aligned parts)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill the batch with new prompts."""
    max_refills: int = 4
    """Most extra rollout rounds per step that dynamic sampling may run."""
    overlong: str = "none"
    """Completions cut at max_new_tokens: none, filter (no loss), or penalty (DAPO soft penalty)."""
    overlong_buffer: int = 16
    """Length of the soft-penalty ramp before max_new_tokens (penalty mode)."""
    kl_reference: bool = False
    """Keep a frozen copy of the initial policy for the KL term (loss.kl_coef > 0 needs it)."""

    def __post_init__(self):
        _choice("algorithm.advantage", self.advantage, ["grpo", "drgrpo", "rloo"])
        _choice("algorithm.overlong", self.overlong, ["none", "filter", "penalty"])
        _at_least("algorithm.epochs", self.epochs, 1)
        _at_least("algorithm.minibatches", self.minibatches, 1)
        _at_least("algorithm.max_refills", self.max_refills, 0)
        _at_least("algorithm.overlong_buffer", self.overlong_buffer, 1)


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """adamw, rmsprop, or muon (torch.optim.Muon, where the installed torch has it; 2-D weights only)."""
    lr: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps, then constant."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 turns it off."""

    def __post_init__(self):
        _choice("optim.name", self.name, ["adamw", "rmsprop", "muon"])
        if not self.lr > 0:
            raise ValueError(f"optim.lr: got {self.lr}, expected a number > 0")


@dataclass(kw_only=True)
class EngineConfig:
    backward: str = "stream"
    """stream (the exact streamed backward) or reference (one full-sequence backward per sample)."""
    block_size: int = 0
    """Tokens per block; 0 = the engine's default (or the planner's choice under memory_budget_mb)."""
    memory_budget_mb: int = 0
    """Let the planner pick the block size and rows per batch for this many MiB; 0 = off."""
    reuse_rollout_kv: bool = False
    """Hand the rollout's K/V to the engine (no prefill); only when epochs = minibatches = 1."""
    verify: bool = True
    """Before training, check on a tiny random copy of the model's architecture (seconds, config only)
    that the streamed backward gives the exact gradient (`backstream verify`); stop unless it does.
    Only with backward = "stream"."""

    def __post_init__(self):
        _choice("engine.backward", self.backward, ["stream", "reference"])
        _at_least("engine.block_size", self.block_size, 0)
        _at_least("engine.memory_budget_mb", self.memory_budget_mb, 0)


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 40
    """RL steps: one rollout batch each (and epochs × minibatches optimizer steps)."""
    prompts_per_step: int = 8
    """Prompts sampled per step (each gets rollout.group_size completions)."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    output_dir: str = "runs/demo"
    """Run folder: config, metrics.jsonl, checkpoints, plots."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run folder (oldest deleted first)."""
    log_tensorboard: bool = False
    """Also log to TensorBoard, in RUN_DIR/tensorboard (needs the tensorboard package)."""
    log_wandb: bool = False
    """Also log to Weights & Biases (needs wandb; WANDB_MODE=offline works without an account).
    A resumed run continues the same W&B run."""
    wandb_project: str = "backstream"
    """W&B project name."""
    progress: bool = True
    """Progress on stderr: a redrawing bar on a terminal, one line per step otherwise."""

    def __post_init__(self):
        _at_least("train.steps", self.steps, 1)
        _at_least("train.prompts_per_step", self.prompts_per_step, 1)
        _at_least("train.save_every", self.save_every, 0)
        _at_least("train.keep_checkpoints", self.keep_checkpoints, 1)


LOSSES = {"ppo_clip": PPOClipConfig, "gspo": GSPOConfig}

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "rollout": SamplingConfig, "reward": RewardConfig,
    "algorithm": AlgorithmConfig, "loss": PPOClipConfig, "optim": OptimConfig, "engine": EngineConfig,
    "train": TrainConfig,
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: SamplingConfig = field(default_factory=lambda: SamplingConfig(group_size=8, max_new_tokens=8))
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: Any = field(default_factory=PPOClipConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def _choice(key: str, value, allowed: list) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: got {value!r}, expected one of {allowed}")


def _at_least(key: str, value, lo: int) -> None:
    if value < lo:
        raise ValueError(f"{key}: got {value}, expected an integer >= {lo}")


def _coerce(key: str, value, annotation):
    """Check a TOML value against a field's annotation (ints are accepted for floats)."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"list": list, "float": float, "int": int, "str": str, "bool": bool, "None": None})  # noqa: S307
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
        raise ValueError(errors[0] if errors else f"{key}: got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{key}: got {value!r}, expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ValueError(f"{key}: got {value!r} ({type(value).__name__}), expected {hint.__name__}")
    return value


def _build(section: str, cls: type, values: dict):
    if not isinstance(values, dict):
        raise ValueError(f"[{section}]: expected a table of keys, got {values!r}")
    if section == "loss":
        kind = values.get("type", "ppo_clip")
        _choice("loss.type", kind, list(LOSSES))
        cls = LOSSES[kind]
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ValueError(f"{section}.{key}: unknown key; the keys of [{section}] are {sorted(names)}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(f"{section}.{k}", v, hints.get(k, Any)) for k, v in values.items()}
    if section == "rollout":  # the run's defaults differ from the sampler's
        kwargs = {"group_size": 8, "max_new_tokens": 8, **kwargs}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required key
        raise ValueError(f"[{section}]: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' → (section, key, value); the value is read as TOML, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set {text!r}: expected section.key=value, e.g. --set optim.lr=3e-4")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs
    return section, key, value


def load(path: str | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """Read a TOML run file (or none: all defaults), apply overrides, validate every section."""
    raw: dict = dict(base or {})
    if path:
        with open(path, "rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{path}: not valid TOML ({e})") from None
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    for section in raw:
        if section not in SECTIONS:
            raise ValueError(f"[{section}]: unknown section; the sections are {list(SECTIONS)}")
    return RunConfig(**{s: _build(s, cls, raw.get(s, {})) for s, cls in SECTIONS.items()})


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
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
                docs[a.target.id] = " ".join(str(b.value.value).split())
    return docs


def describe() -> str:
    """Every section and key with its default and documentation (for `backstream train --help`)."""
    lines = []
    defaults = RunConfig()
    for section, cls in SECTIONS.items():
        classes = list(LOSSES.values()) if section == "loss" else [cls]
        for c in classes:
            title = f"[{section}]" + (f"  (type = \"{c().type}\")" if section == "loss" else "")
            lines.append(title)
            docs = field_docs(c)
            inst = c() if section == "loss" else getattr(defaults, section)
            for f in dataclasses.fields(c):
                lines.append(f"  {f.name} = {getattr(inst, f.name)!r}")
                if f.name in docs:
                    lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
