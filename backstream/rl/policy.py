"""The policy to train, built once from `[model]`: the built-in default model, a Hub id or a local
folder (or a model object the caller passes), in the run's dtype, on its device, in eval mode (no
dropout: the backward must be that of the sampled policy), with PEFT LoRA adapters when asked.

When the data holds images, a composite checkpoint loads as its image-text class with its processor
(`load_processor`). On a CPU machine torchvision does not install beside the CPU torch, and some
processors (Qwen-VL's) cannot be built without it, for their video part: the same processor class is
then built without that part, its image processor the PIL one (which transformers picks there)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from backstream.checks import UserError, at_least, literals
from backstream.stream.hf import locate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "default"
    """"default" for the built-in tiny model (no download), or a hub id / local folder of a causal LM."""
    dtype: Literal[tuple(DTYPES)] = "float32"
    """Parameter dtype: float32, bfloat16 or float64."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""
    trust_remote_code: bool = False
    """Run the Python code a Hub model ships with its weights (only for a model you trust)."""
    freeze_vision: bool = True
    """A vision-language model (data with images): keep its vision tower and projector frozen, as most
    VLM RL recipes do; false trains them with the exact gradient (the tower run with a graph once per
    image per minibatch). No effect on a text model."""

    def __post_init__(self):
        literals(self, "model")
        at_least("model.lora_r", self.lora_r, 0)
        if self.name.startswith("~"):  # a folder under the home directory, as a shell would read it
            self.name = os.path.expanduser(self.name)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("model.device: 'cuda' asked for but no GPU is visible; use 'auto' or 'cpu'")
        return torch.device(self.device)

    def build(self, model=None, tokenizer=None, images: bool = False):
        """(model, tokenizer): `model` and `tokenizer` when given (cast to `dtype`), else loaded from
        `name`; on `device`, in eval mode, with LoRA adapters when `lora_r` > 0. `images`: the data holds
        images: a composite checkpoint loads as its image-text class and the second value is its
        processor (rl/data/images.py), the vision tower frozen under `freeze_vision`."""
        device = self.torch_device()
        if model is None:
            model, tokenizer = self._load(images)
            model, base = model.to(device), self.base_name(images)
        elif tokenizer is None:
            raise UserError("tokenizer: required when a model object is passed")
        else:
            model, base = model.to(device, DTYPES[self.dtype]), _loaded_from(model)
        if images:
            from backstream.stream.hf import image_path  # noqa: PLC0415

            if not image_path(model):
                raise UserError(f"model.name: the data holds images, but {type(model).__name__} has no vision tower "
                                "(a text model); use a vision-language model, or data without images")
            if self.freeze_vision:
                outside = image_path(model)
                for m in model.modules():
                    if id(m) in outside:
                        m.requires_grad_(False)
        return self.apply_lora(model.eval(), base), tokenizer

    def _load(self, images: bool = False):
        dtype = DTYPES[self.dtype]
        if self.name == "default":
            if images:
                from backstream.tiny_vlm import load_tiny_vlm  # noqa: PLC0415

                return load_tiny_vlm(dtype=dtype)
            from backstream.default_model import load_default  # noqa: PLC0415

            return load_default(dtype=dtype)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer  # noqa: PLC0415

        locate(self.name, "model.name")  # a folder or a Hub id, else named at once (no Hub retries)
        try:
            trust = self.trust_remote_code
            if images:  # the composite class (AutoModelForCausalLM would drop a qwen3_5's tower silently)
                processor = load_processor(self.name, trust)
                try:
                    model = AutoModelForImageTextToText.from_pretrained(self.name, dtype=dtype, trust_remote_code=trust,
                                                                        use_safetensors=True)
                except ValueError as e:
                    if "Unrecognized configuration class" not in str(e):
                        raise
                    raise UserError(f"model.name: the data holds images, but {self.name} is not a vision-language "
                                    "model transformers can load as image-text-to-text; use one, or data without "
                                    "images") from None
                return model, processor
            tok = AutoTokenizer.from_pretrained(self.name, trust_remote_code=trust)
            # weights from safetensors only: a pickled .bin checkpoint can run code when loaded
            model = AutoModelForCausalLM.from_pretrained(self.name, dtype=dtype, trust_remote_code=trust,
                                                         use_safetensors=True)
            return model, tok
        except OSError as e:
            raise UserError(f"model.name: cannot load {self.name!r} ({e})") from None

    def apply_lora(self, model, base: str | None = None):
        """LoRA adapters when `lora_r` > 0; `base`: what a saved adapter names as its base model."""
        if self.lora_r == 0:
            return model
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        from backstream.stream.hf import text_part  # noqa: PLC0415

        targets, text = self.lora_targets, text_part(model)
        if text is not None:  # a VLM: the names in the language model only (a CLIP tower has q_proj too)
            targets = rf".*{text[0]}.*\.({'|'.join(map(re.escape, targets))})"
        try:
            peft = get_peft_model(model, LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha,
                                                    target_modules=targets))
        except ValueError as e:
            if "not found in the base model" not in str(e) and "Target modules" not in str(e):
                raise
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"})
            raise UserError(f"model.lora_targets: {self.lora_targets} match no module of {type(model).__name__}; "
                             f"its linear layers are named {leaves} (set model.lora_targets to some of them, e.g. "
                             "[\"q_proj\", \"v_proj\"])") from None
        # the adapter names its base, so that a saved adapter loads with PeftModel.from_pretrained (or
        # AutoPeftModelForCausalLM) alone. Set after get_peft_model, which overwrites a name the config
        # brings with the model's own (None for a model built in memory) and warns that it "renamed" it
        for cfg in peft.peft_config.values():
            cfg.base_model_name_or_path = base
        return peft

    def base_name(self, images: bool = False) -> str:
        """The model `name` loads: the built-in model's folder (the tiny VLM's for data with `images`), a
        local folder (absolute) or a Hub id."""
        if self.name == "default" and images:
            from backstream.tiny_vlm import TINY_VLM_DIR  # noqa: PLC0415

            return str(TINY_VLM_DIR)
        if self.name == "default":
            from backstream.default_model import DEFAULT_MODEL_DIR  # noqa: PLC0415

            return str(DEFAULT_MODEL_DIR)
        return os.path.abspath(self.name) if os.path.isdir(self.name) else self.name


def _loaded_from(model) -> str | None:
    """The folder (absolute) or Hub id a model object was loaded from; None for one built in memory."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or None
    return os.path.abspath(name) if name and os.path.isdir(name) else name


def reference_policy(kl_reference: bool, policy: ModelConfig, quant, model, copy_of_given: bool):
    """The frozen reference policy of the KL term (update.kl_reference; `policy`: [model], `quant`:
    [quant]): the initial policy, copied from the `model` passed in or loaded again (quantized as the
    learner computes it). None when not asked for, and with LoRA, where the base model under the
    adapters is the reference."""
    if not kl_reference or policy.lora_r > 0:
        return None
    if copy_of_given:
        ref = copy.deepcopy(model)  # before any update: the initial policy
    else:
        from backstream.stream.hf import image_path  # noqa: PLC0415

        ref, _ = dataclasses.replace(policy, lora_r=0).build(images=bool(image_path(model)))
        if quant.enabled:
            from backstream.quant.linear import quantize_model  # noqa: PLC0415

            quantize_model(ref, quant)
    return ref.requires_grad_(False)


def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a turn: the tokenizer's EOS and the model's generation config's (a chat
    model's end-of-turn token, <|im_end|> say, is often only there)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
    return list(dict.fromkeys(ids))


def load_processor(name: str, trust_remote_code: bool = False):
    """The model folder's processor (`AutoProcessor`); where it cannot be built without torchvision
    (the video part of Qwen-VL's), the same processor class built from its image processor (the PIL
    one), tokenizer and chat template alone."""
    from transformers import AutoProcessor  # noqa: PLC0415

    try:
        return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (ImportError, ValueError, AttributeError, TypeError, OSError) as e:  # (OSError: no video config)
        first = e
    return _images_only(name, trust_remote_code, first)


def _images_only(name: str, trust_remote_code: bool, error: Exception):
    import transformers  # noqa: PLC0415
    from transformers import AutoImageProcessor, AutoTokenizer  # noqa: PLC0415

    cls_name = None
    for fname in ("processor_config.json", "preprocessor_config.json"):
        path = os.path.join(name, fname)
        if os.path.exists(path):
            with open(path) as f:
                cls_name = cls_name or json.load(f).get("processor_class")
    if cls_name is None:
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # noqa: PLC0415

        cfg = transformers.AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        cls_name = PROCESSOR_MAPPING_NAMES.get(cfg.model_type)
    cls = getattr(transformers, cls_name or "", None)
    if cls is None:
        raise UserError(f"model.name: cannot build {name}'s processor ({type(error).__name__}: {error})") from None
    attrs = [a for a in cls.get_attributes() if a in ("image_processor", "tokenizer")]
    if len(attrs) != len(cls.get_attributes()) - 1 or "video_processor" not in cls.get_attributes():
        raise UserError(f"model.name: cannot build {name}'s processor {cls_name} ({type(error).__name__}: {error})") \
            from None
    from backstream.tiny_vlm import images_only  # noqa: PLC0415  (the one image-only processor class)

    template = None
    for fname in ("chat_template.jinja", "chat_template.json"):
        path = os.path.join(name, fname)
        if os.path.exists(path):
            with open(path) as f:
                template = f.read() if fname.endswith(".jinja") else json.load(f).get("chat_template")
            break
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    ip = AutoImageProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    return images_only(cls)(image_processor=ip, tokenizer=tok, video_processor=None,
                       chat_template=template or getattr(tok, "chat_template", None))


def tokenizer_of(processor):
    """The text tokenizer of a processor (the tokenizer itself otherwise)."""
    return getattr(processor, "tokenizer", processor)
