"""`verify`: does the streamed backward compute the exact gradient on this architecture? (issue 7,
docs/design.md §6b.)

The engine drives a model through transformers' Cache and attention interface, which is exact only
if the model keeps the family contract (plain softmax attention over the K/V the cache returned,
positions only through `position_ids`, a deterministic forward). The run-time guards refuse what they
can see; this module checks the rest by experiment, per architecture: `verify(model_or_config)` builds
the float64 miniature of the architecture (`backstream.stream.miniature`), runs `stream_backward`
against `reference_backward` on a token tree with every shape a trainer makes (`token_tree`: a GRPO
group on a shared prompt, a second turn on top of one response, a duplicate, a one-token and a
zero-weight sequence, an unrelated sequence) at block sizes 1 (2 for a model whose layers keep
recurrent or convolution state: its blocks are at least 2 tokens), 3 and 16, and compares every
parameter's gradient with the rule of the engine tests (`relative_errors`: relative error, judged
against a thousandth of the largest gradient for parameters whose true gradient is ~0), under
`keep_float64` so that HF's float32 upcasts add no 1e-7 noise.

Verdicts (`Verdict`, each with the exit code of `backstream verify`): `exact` (every error ≤ 1e-10),
`refused: <reason>` (the engine said it cannot: a `family.ModelContractError`), `wrong` (it ran and
differs: the worst outcome), `could not build: <reason>` (the miniature or the reference itself
failed) and `error: <exception>` (stream_backward crashed).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import Tensor, nn

from backstream.stream.family import ModelContractError, Unsupported
from backstream.stream.hf import EXPERT_KEYS, TOP_K_KEYS, base_model, image_path
from backstream.stream.miniature import (
    VOCAB,
    WINDOW_KEYS,
    is_image_text,
    keep_float64,
    load_config,
    miniature,
    special_ids,
    vision_miniature,
)

TOL = 1e-10
BLOCK_SIZES = (1, 3, 16)


class Verdict(StrEnum):
    """What `verify` found, with the exit code `backstream verify` returns for it (`exit_code`)."""

    exit_code: int

    def __new__(cls, value: str, exit_code: int):
        member = str.__new__(cls, value)
        member._value_ = value
        member.exit_code = exit_code
        return member

    EXACT = "exact", 0
    REFUSED = "refused", 1
    COULD_NOT_BUILD = "could not build", 2
    WRONG = "wrong", 3
    ERROR = "error", 3


# ---------------------------------------------------------------------------------------------
# The comparison


_ROLES = (  # first match wins; names lower-cased
    ("lm_head", ("lm_head", "embed_out", "output_layer")),
    ("embed", ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")),
    ("norm", ("norm", "ln_", ".ln", "layernorm")),
    ("router/experts", ("router", "expert", ".gate.", ".gate_weight", "moe", "e_score_correction")),
)
_ATTN = (("attn.qkv", ("qkv", "c_attn", "query_key_value", "kv_a_proj", "kv_b_proj", "kv_proj")),
         ("attn.q", ("q_proj", "q_a_proj", "q_b_proj", "query", ".wq", ".q.")),
         ("attn.k", ("k_proj", ".key", ".wk", ".k.")),
         ("attn.v", ("v_proj", ".value", ".wv", ".v.")),
         ("attn.o", ("o_proj", "out_proj", "c_proj", "dense", ".wo", ".o.")))
_MLP = ("mlp", "ffn", "feed_forward", "fc1", "fc2", "c_fc", "gate_proj", "up_proj", "down_proj")
ROLE_ORDER = ("embed", "attn.q", "attn.k", "attn.v", "attn.qkv", "attn.o", "attn.other", "mlp",
              "router/experts", "norm", "lm_head", "other")


def role(name: str) -> str:
    """The role of a parameter from its name: embed, attn.q/k/v/qkv/o/other, mlp, router/experts,
    norm, lm_head or other (LoRA tensors take the role of the layer they adapt)."""
    n = name.lower()
    for r, pats in _ROLES:
        if any(p in n for p in pats):
            return r
    if any(p in n for p in ("attn", "attention", "sinks", "mixer")):
        return next((r for r, pats in _ATTN if any(p in n for p in pats)), "attn.other")
    if any(p in n for p in _MLP):
        return "mlp"
    return next((r for r, pats in _ATTN if any(p in n for p in pats)), "other")


def token_tree(gen: torch.Generator, allowed: Tensor, prompt=9, lens=(5, 7, 3, 7)):
    """(sequences, weights) drawn with `gen` from the token ids `allowed`: a GRPO group (shared prompt,
    unequal responses `lens`), a duplicate, a second turn on top of response 0, an unrelated sequence,
    a one-token sequence and a zero-advantage response; no loss on the prompt (nor on index 0)."""
    ids = lambda n: allowed[torch.randint(0, len(allowed), (n,), generator=gen)]  # noqa: E731
    P = ids(prompt)
    seqs = [torch.cat([P, ids(n)]) for n in lens]
    seqs.append(seqs[1].clone())
    seqs.append(torch.cat([seqs[0], ids(4)]))
    seqs.append(ids(6))
    seqs.append(ids(1))
    seqs.append(torch.cat([P, ids(5)]))
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    for i, w in enumerate(weights):
        w[0] = 0
        if i < len(lens) + 2:
            w[:prompt] = 0
    weights[-1].zero_()
    weights[-2].zero_()
    return seqs, weights


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_errors(g: dict, g_ref: dict) -> dict[str, float]:
    """Per parameter, ‖g − g_ref‖ over ‖g_ref‖, or over a thousandth of the largest reference
    gradient when that is larger (a parameter whose true gradient is 0, q_proj when every query sees
    one key, holds rounding noise only); a parameter missing on one side counts as a zero gradient
    there, a non-finite error as inf."""
    floor = 1e-3 * max(float(x.norm()) for x in g_ref.values())
    out = {}
    for n in g_ref.keys() | g.keys():
        ref = g_ref.get(n)
        got = g.get(n)
        if ref is None:
            ref = torch.zeros_like(got)
        if got is None:
            got = torch.zeros_like(ref)
        err = float((got - ref).norm()) / max(float(ref.norm()), floor, 1e-300)
        out[n] = err if math.isfinite(err) else math.inf
    return out


def _logprob_error(lp, lp_ref, weights) -> float:
    worst = 0.0
    for a, b, w in zip(lp, lp_ref, weights):
        m = w != 0
        if not m.any():
            continue
        d = (a[m].double() - b[m].double()).abs()
        worst = max(worst, math.inf if torch.isnan(d).any() else float(d.max()))
    return worst




# ---------------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What `verify` found: `kind` and, except for `exact`, a `reason` (refused, could not build,
    error: the message; wrong: the worst parameter and its error). `errors[role]` holds the worst
    relative gradient error of that role's parameters at each of `block_sizes` (None where that run
    did not happen)."""

    model_type: str
    kind: Verdict
    reason: str = ""
    architecture: str = ""
    features: dict = field(default_factory=dict)
    block_sizes: tuple = BLOCK_SIZES
    errors: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # role → number of parameter tensors with a gradient
    logprob_error: list = field(default_factory=list)  # per block size
    worst_parameter: str = ""
    seconds: float = 0.0
    tolerance: float = TOL
    image_tokens: int | None = None  # checked with an image of this many placeholder tokens (images=True)
    image_forward_error: float | None = None  # the reference with the image against the model's own forward
    tower_trained: bool | None = None  # with an image: whether the vision tower (and projector) took a gradient

    def __post_init__(self):
        self.kind = Verdict(self.kind)

    @property
    def ok(self) -> bool:
        return self.kind is Verdict.EXACT

    @property
    def verdict(self) -> str:
        """"exact", "wrong", or "<kind>: <reason>" (refused, could not build, error)."""
        if self.kind in (Verdict.EXACT, Verdict.WRONG):
            return self.kind.value
        return f"{self.kind.value}: {self.reason}"

    @property
    def worst(self) -> float | None:
        vals = [x for row in self.errors.values() for x in row if x is not None]
        vals += [x for x in self.logprob_error if x is not None]
        return max(vals) if vals else None

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "verdict": self.verdict, "kind": self.kind.value, "reason": self.reason,
                "worst_error": self.worst, "architecture": self.architecture, "features": self.features,
                "block_sizes": list(self.block_sizes), "errors": self.errors, "tensors": self.tensors,
                "logprob_error": self.logprob_error, "worst_parameter": self.worst_parameter,
                "seconds": round(self.seconds, 2), "tolerance": self.tolerance, "image_tokens": self.image_tokens,
                "image_forward_error": self.image_forward_error, "tower_trained": self.tower_trained}

    def __str__(self) -> str:
        fmt = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
        lines = [f"backstream verify: {self.model_type}" + (f" ({self.architecture})" if self.architecture else "")]
        if self.features:
            lines.append("miniature: " + ", ".join(f"{k} {v}" for k, v in self.features.items()))
        if self.image_tokens is not None:
            own = "" if self.image_forward_error is None else \
                f"; the reference equals the model's own forward from pixels to {self.image_forward_error:.1e}"
            tower = "trained" if self.tower_trained is not False else "frozen"
            lines.append(f"with an image: {self.image_tokens} image tokens in every prompt, the vision tower "
                         f"{tower}{own}")
        if self.errors:
            lines.append("")
            head = f"{'parameters':<16}{'tensors':>8}" + "".join(f"{f'block {b}':>11}" for b in self.block_sizes)
            lines.append(head)
            lines.append("-" * len(head))
            for r in ROLE_ORDER:
                if r in self.errors:
                    cells = "".join(f"{fmt(x):>11}" for x in self.errors[r])
                    lines.append(f"{r:<16}{self.tensors.get(r, 0):>8}" + cells)
            lines.append(f"{'log-probs':<16}{'':>8}" + "".join(f"{fmt(x):>11}" for x in self.logprob_error))
            lines.append("")
        tail = f"verdict: {self.verdict}"
        if self.kind is Verdict.WRONG:
            tail += f" ({self.reason}; tolerance {self.tolerance:.0e})"
        elif self.kind is Verdict.EXACT and self.worst is not None:
            tail += f" (worst relative error {self.worst:.1e} <= {self.tolerance:.0e})"
        lines.append(tail + f"  [{self.seconds:.1f} s]")
        return "\n".join(lines)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(c, key: str):
    try:  # heterogeneous configs raise on per-layer attributes read globally
        return getattr(c, key, None)
    except Exception:  # noqa: BLE001
        return None


def _features(model: nn.Module) -> dict:
    """The miniature's features worth printing (what makes the architecture what it is)."""
    c = model.config.get_text_config()
    out = {"layers": _get(c, "num_hidden_layers")}
    lt = _get(c, "layer_types")
    if lt:
        out["layer_types"] = "/".join(dict.fromkeys(map(str, lt)))
    rp = _get(c, "rope_parameters") or {}
    nested = rp and all(isinstance(x, dict) or x is None for x in rp.values())
    kinds = {p.get("rope_type") for p in (rp.values() if nested else [rp]) if isinstance(p, dict)}
    kinds -= {"default", None}
    if kinds:
        out["rope"] = "/".join(sorted(map(str, kinds)))
    for k in (*WINDOW_KEYS, "kv_lora_rank", "q_lora_rank", "attn_logit_softcapping", "final_logit_softcapping"):
        v = _get(c, k)
        if v is not None and v is not False and v != 0:
            out[k] = v
    for k in EXPERT_KEYS:
        v = _get(c, k)
        if _is_int(v) and v > 1:
            top = next((_get(c, t) for t in TOP_K_KEYS if _is_int(_get(c, t))), "?")
            out["experts"] = f"{v} top-{top}"
            break
    peft = getattr(model, "peft_config", None)
    if peft:
        out["lora"] = f"r={next(iter(peft.values())).r}"
    if model.training:
        out["mode"] = "train"
    return {k: v for k, v in out.items() if v is not None}


def _lora(mini: nn.Module, model: nn.Module):
    """The PEFT LoRA config of `model` applied to the miniature (random A and B, float64)."""
    peft_cfg = getattr(model, "peft_config", None)
    if not peft_cfg:
        return mini
    from peft import get_peft_model  # noqa: PLC0415

    name = getattr(model, "active_adapter", None)
    chosen = peft_cfg.get(name) if isinstance(name, str) and name in peft_cfg else next(iter(peft_cfg.values()))
    cfg = copy.deepcopy(chosen)
    if getattr(cfg, "peft_type", None) is None or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
        raise Unsupported(f"model: only LoRA adapters are verified, got {cfg.peft_type}")
    cfg.init_lora_weights = False  # B ≠ 0: every LoRA tensor gets a gradient
    cfg.base_model_name_or_path = None  # the miniature is not that base (PEFT would warn it was "renamed")
    cfg.inference_mode = False
    layers = getattr(cfg, "layers_to_transform", None)
    if layers is not None:  # the miniature has 2 layers: adapt the same relative part of the stack
        cfg.layers_to_transform = (None if isinstance(layers, int) and layers > 1
                                   else [0] if isinstance(layers, int) else None)
    pm = get_peft_model(mini, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64)
    return pm


def _short(e: BaseException, n: int = 300) -> str:
    msg = " ".join(str(e).split())
    return (msg[:n] + "…") if len(msg) > n else msg


def _image_layouts(mini: nn.Module) -> list[dict]:
    """Random inputs of one image for a miniature's tower, in the layouts towers take (the first that
    `get_image_features` accepts is used): a Qwen-VL tower's 2m × 2m flattened patches
    (`image_grid_thw`: 4 tokens after its m × m merge); a SigLIP-2 (NaFlex) tower's 4 × 4 flattened
    patches with `spatial_shapes` and a patch mask; a CLIP/SigLIP tower's one square image [1, C, S, S]
    (with `image_sizes` where the family asks for them), then the same as a batch of one [1, 1, C, S, S]
    (Idefics)."""
    import inspect  # noqa: PLC0415

    base = base_model(mini)
    vc = base.config.vision_config
    takes = inspect.signature(base.get_image_features).parameters
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    C = next((getattr(vc, k) for k in ("in_channels", "in_chans", "num_channels") if _is_int(getattr(vc, k, None))), 3)
    P = getattr(vc, "patch_size", None)
    P = P[0] if isinstance(P, (list, tuple)) and P else P
    if _is_int(getattr(vc, "spatial_merge_size", None)) and _is_int(getattr(vc, "temporal_patch_size", None)):
        m, T = vc.spatial_merge_size, vc.temporal_patch_size
        return [{"pixel_values": rand(4 * m * m, C * T * P * P), "image_grid_thw": torch.tensor([[1, 2 * m, 2 * m]])}]
    if "spatial_shapes" in takes and _is_int(P):
        return [{"pixel_values": rand(1, 16, C * P * P), "spatial_shapes": torch.tensor([[4, 4]]),
                 "pixel_attention_mask": torch.ones(1, 16, dtype=torch.long)}]
    S = getattr(vc, "image_size", None)
    S = S[0] if isinstance(S, (list, tuple)) and S else S
    if not _is_int(S):
        raise ValueError(f"{type(vc).__name__}: no known way to make an image for this tower")
    one = {"pixel_values": rand(1, C, S, S)}
    if "image_sizes" in takes:
        one["image_sizes"] = torch.tensor([[S, S]])
    return [one, {**one, "pixel_values": one["pixel_values"][None]}]


def image_inputs(mini: nn.Module) -> tuple[dict, list[Tensor]]:
    """One image's inputs for the miniature's tower (`_image_layouts`, the first its
    `get_image_features` takes) and the tower's output rows for it."""
    from backstream.stream import vision  # noqa: PLC0415

    first = None
    for inputs in _image_layouts(mini):
        try:
            with keep_float64(), torch.no_grad():
                rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
                return inputs, vision.tower(mini, inputs["pixel_values"], **rest)[0]
        except ModelContractError:
            raise
        except Exception as e:  # noqa: BLE001  (the next layout, or the first layout's error)
            first = first or e
    raise first


def _with_image(mini: nn.Module, seqs: list[Tensor], weights: list[Tensor]):
    """The tree with one image in front of every sequence (its placeholders, between the family's
    vision start and end tokens where it has them), weight 0 there, and its `Picture`."""
    from backstream.stream import vision  # noqa: PLC0415

    inputs, n = image_inputs(mini)
    pic = vision.Picture("verify", inputs, sum(f.reshape(-1, f.shape[-1]).shape[0] for f in n))
    cfg = base_model(mini).config
    span = [vision.image_token(mini)] * pic.tokens
    start, end = getattr(cfg, "vision_start_token_id", None), getattr(cfg, "vision_end_token_id", None)
    span = ([start] if _is_int(start) else []) + span + ([end] if _is_int(end) else [])
    span_t = torch.tensor(span)
    seqs = [torch.cat([s[:2], span_t, s[2:]]) for s in seqs]
    weights = [torch.cat([w[:2], torch.zeros(len(span), dtype=w.dtype), w[2:]]) for w in weights]
    return seqs, weights, pic


def _own_forward_error(mini: nn.Module, seqs, weights, pic, lp_ref) -> float:
    """The largest |log-prob| difference between the reference with images and the model's own forward
    from the image's inputs (what the engine's contract leaves out, a family's extra use of the image,
    shows here)."""
    import inspect  # noqa: PLC0415

    from backstream.stream import vision  # noqa: PLC0415

    takes = inspect.signature(base_model(mini).forward).parameters
    worst = 0.0
    with keep_float64(), torch.no_grad():
        for s, w, lp in zip(seqs, weights, lp_ref):
            kw = dict(pic.inputs)
            if "mm_token_type_ids" in takes:
                kw["mm_token_type_ids"] = (s == vision.image_token(mini)).int()[None]
            logits = mini(input_ids=s[None], **kw).logits[0, :-1]
            own = logits.log_softmax(-1).gather(-1, s[1:, None])[:, 0]
            m = w[1:] != 0
            if bool(m.any()):
                worst = max(worst, float((own[m] - lp[1:][m]).abs().max()))
    return worst


def verify(model_or_config, *, seed: int = 0, block_sizes=BLOCK_SIZES, stage=None,
           images: bool | None = None, freeze_vision: bool = False) -> VerifyReport:
    """Check on a miniature of the architecture that `stream_backward` gives the gradient of
    `reference_backward` (see the module docstring). `model_or_config`: a model (its config; a PEFT
    LoRA model also gets the same LoRA config; a model in train mode is verified in train mode), a
    config, "default", a local folder, a transformers model_type or a Hub id (config.json only).
    `images`: check a vision-language model's image-text class with an image in every prompt, the
    tower trained (its gradient compared too), and the reference with the image against the model's
    own forward from pixels; None: for a model with a vision tower, or a composite config that
    transformers loads as image-text-to-text. `freeze_vision` (with images): the tower and projector
    (`hf.image_path`) take no gradient, so the image rows are constants, as in a run that trains the
    decoder only. `stage`, if given, is called with the name of each step
    (for progress and time limits)."""
    from backstream.stream.engine import stream_backward  # noqa: PLC0415
    from backstream.stream.reference import reference_backward  # noqa: PLC0415

    t0 = time.perf_counter()
    say = stage or (lambda s: None)
    label = model_or_config if isinstance(model_or_config, str) else ""
    rep = VerifyReport(model_type=str(label), kind=Verdict.ERROR, reason="unfinished", block_sizes=tuple(block_sizes))

    def done(kind: Verdict, reason: str = "") -> VerifyReport:
        rep.kind, rep.reason, rep.seconds = kind, reason, time.perf_counter() - t0
        return rep

    say("build")
    try:
        config = load_config(model_or_config)
        rep.model_type = getattr(config, "model_type", "") or rep.model_type
        is_model = isinstance(model_or_config, nn.Module)
        if images is None:
            images = bool(image_path(model_or_config)) if is_model else is_image_text(config)
        training = bool(is_model and model_or_config.training)
        mini = (vision_miniature if images else miniature)(config, seed=seed, training=training)
        if is_model:
            mini = _lora(mini, model_or_config)
        rep.architecture = type(base_model(mini)).__name__
        rep.features = _features(mini)
        gen = torch.Generator().manual_seed(seed)
        allowed = torch.tensor([i for i in range(VOCAB) if i not in special_ids(base_model(mini).config)])
        seqs, weights = token_tree(gen, allowed)
        pic = None
        if images:
            seqs, weights, pic = _with_image(mini, seqs, weights)
            rep.image_tokens = pic.tokens
            rep.tower_trained = not freeze_vision
            if freeze_vision:
                outside = image_path(mini)
                for m in base_model(mini).modules():
                    if id(m) in outside:
                        m.requires_grad_(False)
    except ModelContractError as e:  # the engine's own refusal while encoding the image (stream/vision.py)
        return done(Verdict.REFUSED, _short(e))
    except Exception as e:  # noqa: BLE001  (anything the config or transformers raise)
        return done(Verdict.COULD_NOT_BUILD, f"{type(e).__name__}: {_short(e)}")

    def run(fn, **kw):
        mini.zero_grad(set_to_none=True)
        threads = torch.get_num_threads()
        # a width-32 model gains nothing from threads, and on a busy machine their spinning costs 10x
        torch.set_num_threads(1)
        try:
            with keep_float64():
                if pic is not None:  # a trained tower is encoded with its graph for each call
                    from backstream.stream import vision  # noqa: PLC0415

                    kw["images"] = vision.images_for(mini, seqs, [[pic.fresh()]] * len(seqs),
                                                     grad=not freeze_vision)
                res = fn(mini, seqs, weights, **kw)
        finally:
            torch.set_num_threads(threads)
        return _grads(mini), res

    results, failure = {}, None
    for b in block_sizes:
        say(f"stream_backward block {b}")
        try:
            results[b] = run(stream_backward, block_size=b)
        except Exception as e:  # noqa: BLE001
            failure = e
            break
    # the reference decides whether the miniature runs at all: an engine refusal or crash on a
    # model that cannot even run its own forward and backward says nothing about the engine
    say("reference")
    try:
        g_ref, r_ref = run(reference_backward)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ModelContractError):  # reference_backward checks the model as stream_backward does
            return done(Verdict.REFUSED, _short(e))
        return done(Verdict.COULD_NOT_BUILD, f"the reference backward failed: {type(e).__name__}: {_short(e)}")
    if isinstance(failure, ModelContractError):
        return done(Verdict.REFUSED, _short(failure))
    if not g_ref or max(float(x.norm()) for x in g_ref.values()) == 0:
        return done(Verdict.COULD_NOT_BUILD, "the reference backward computed no gradient")
    if failure is not None:
        return done(Verdict.ERROR, f"{type(failure).__name__}: {_short(failure)}")
    if pic is not None:
        try:
            rep.image_forward_error = _own_forward_error(mini, seqs, weights, pic, r_ref.logprobs)
        except Exception as e:  # noqa: BLE001
            return done(Verdict.COULD_NOT_BUILD, f"the model's own forward with the image failed: "
                                                 f"{type(e).__name__}: {_short(e)}")
        if rep.image_forward_error > TOL:
            return done(Verdict.REFUSED, f"the model's own forward with an image differs from the decoder over "
                                         f"the tower's output at its placeholders (log-probs off by "
                                         f"{rep.image_forward_error:.2g}): the family uses the image beyond the "
                                         "contract (docs/vision.md)")

    roles = {n: role(n) for n in g_ref}
    for n, r in roles.items():
        rep.tensors[r] = rep.tensors.get(r, 0) + 1
    rep.errors = {r: [None] * len(block_sizes) for r in rep.tensors}
    worst = (-1.0, "")
    for j, b in enumerate(block_sizes):
        g, res = results[b]
        for n, err in relative_errors(g, g_ref).items():
            r = roles.get(n) or role(n)
            rep.errors.setdefault(r, [None] * len(block_sizes))
            rep.errors[r][j] = max(err, rep.errors[r][j] or 0.0)
            if err > worst[0]:
                worst = (err, f"{n} (block {b})")
        rep.logprob_error.append(_logprob_error(res.logprobs, r_ref.logprobs, weights))
        if rep.logprob_error[-1] > worst[0]:
            worst = (rep.logprob_error[-1], f"log-probs (block {b})")
    rep.worst_parameter = worst[1]
    if rep.worst is None:  # no block size was asked for: nothing shows the gradient is exact
        return done(Verdict.WRONG)
    if rep.worst <= TOL:
        return done(Verdict.EXACT)
    return done(Verdict.WRONG, f"{rep.worst_parameter}: relative error {rep.worst:.2g}")
