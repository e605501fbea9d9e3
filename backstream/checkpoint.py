"""Checkpoints in Hugging Face format, written atomically; sharded with DCP under torch.distributed.

A checkpoint is a folder `checkpoints/step-N/` holding `save_pretrained` weights (or only the LoRA
adapter), the tokenizer, and `trainer_state.pt` (optimizer, LR schedule, RNG states, data
position, step). It is written under a temporary name and renamed into place only when complete,
so a kill during the write leaves the previous checkpoint as the latest loadable one.

Under torch.distributed (more than one rank, or DTensor parameters: FSDP2) every rank takes part.
The sharded model and optimizer state go to `dcp/` with torch.distributed.checkpoint (each rank
writes its own shards, a replicated tensor once); the Hugging Face export is gathered onto rank 0
beside it, so `from_pretrained(step-N)` works as for one process; `trainer_state.pt` holds every
rank's state but the optimizer's. The ranks agree that all of them finished before rank 0 renames
the folder into place: a failure on any rank leaves no `step-N`.

    step-N/  config.json, generation_config.json, model.safetensors (LoRA: adapter_config.json,
             adapter_model.safetensors), tokenizer files, trainer_state.pt,
             step.json ({"step", "sizes" of every file, dcp/ included, "world_size"}),
             dcp/.metadata, dcp/__0_0.distcp ... dcp/__{W-1}_0.distcp

`restore` reads either layout back into a model and optimizer on any number of ranks (DCP
reshards), a single process without a process group included.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import shutil
import warnings

import torch

from backstream.checks import UserError

STATE = "trainer_state.pt"
MANIFEST = "step.json"
DCP = "dcp"


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _world_rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def sharded(model) -> bool:
    """Whether `save` writes the distributed layout: a process group of more than one rank, or a
    model whose parameters are DTensors (FSDP2)."""
    if _world_rank()[0] > 1:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return any(isinstance(p, DTensor) for p in model.parameters())


def _is_lora(model) -> bool:
    return getattr(model, "peft_config", None) is not None


def save(run_dir: str, step: int, model, tokenizer, state: dict, keep: int = 2) -> str:
    """Write `checkpoints/step-{step}` of `run_dir` atomically and keep the newest `keep`; returns its
    folder. `state["optimizer"]` is the optimizer or (one process only) its state_dict. Under
    torch.distributed every rank calls it with its own `state` (collective), the optimizer itself."""
    if sharded(model):
        return _save_sharded(run_dir, step, model, tokenizer, state, keep)
    if isinstance(state.get("optimizer"), torch.optim.Optimizer):
        state = {**state, "optimizer": state["optimizer"].state_dict()}
    root = _ckpt_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a write that a kill interrupted
    try:
        os.makedirs(tmp)
        with quiet():
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, STATE))
        _seal(tmp, {"step": step})
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(e.errno, _failed(step, e.strerror or e, latest(run_dir))) from e
    _publish(run_dir, tmp, final, keep)
    return final


@contextlib.contextmanager
def quiet():
    """transformers' own progress bar off while it writes the weights (the run's bar is on screen)."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _failed(step: int, why, prev: str | None, rank: int | None = None) -> str:
    where = "" if rank is None else f" on rank {rank}"
    return (f"checkpoint: writing step {step} failed{where} ({why}); nothing was replaced, the latest checkpoint is "
            f"still {prev or 'none'}")


def _seal(tmp: str, manifest: dict) -> None:
    """step.json (what resume checks the folder against: every file's size), then every file durable
    before the rename makes the folder visible."""
    files = [os.path.relpath(os.path.join(d, n), tmp) for d, _, names in os.walk(tmp) for n in names]
    sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in files}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({**manifest, "sizes": sizes}, f)
    for name in [*files, MANIFEST]:
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())


def _publish(run_dir: str, tmp: str, final: str, keep: int) -> None:
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


# -- distributed: every rank calls these ---------------------------------------------------------
def _save_sharded(run_dir: str, step: int, model, tokenizer, state: dict, keep: int) -> str:
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    opt = state.get("optimizer")
    if not isinstance(opt, torch.optim.Optimizer):
        raise UserError("checkpoint.save: under torch.distributed, state['optimizer'] must be the optimizer itself "
                         "(its sharded state goes to dcp/ with the model's, not into trainer_state.pt)")
    world, rank = _world_rank()
    rest = {k: v for k, v in state.items() if k != "optimizer"}
    root = _ckpt_dir(run_dir)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    prev = latest(run_dir)
    agree = _Agreement(step, tmp, prev)

    def fresh_folder():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a write that a kill interrupted
            os.makedirs(os.path.join(tmp, DCP))

    def shards():
        # the adapter only for LoRA (the frozen base is the pretrained model the run starts from)
        empty = not opt.state  # get_state_dict initialises an unstepped optimizer: undone below
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=True))
        if empty:
            opt.state.clear()
        dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, DCP)))
        return empty

    def gather():
        full = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=_is_lora(model)))  # on rank 0 only
        states = [None] * world if rank == 0 else None
        dist.gather_object(rest, states, dst=0)
        return full, states

    def export():
        if rank == 0:
            with quiet():
                model.save_pretrained(tmp, state_dict=full)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save({**states[0], "ranks": states}, os.path.join(tmp, STATE))  # ranks[r]: rank r's
            manifest = {"step": step, "world_size": world}
            _seal(tmp, {**manifest, "optimizer_empty": True} if empty else manifest)

    try:
        agree(fresh_folder)
        empty = agree(shards)
        full, states = agree(gather)
        agree(export)
        agree(lambda: rank == 0 and _publish(run_dir, tmp, final, keep))
    except BaseException:
        if rank == 0:  # also when a rank died mid-write and the collectives themselves failed
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class _Agreement:
    """Runs one stage of a distributed save on this rank, then lets every rank know whether any rank
    failed: a failure anywhere removes the temporary folder and raises on every rank, naming the rank
    (so no rank waits forever in a collective the failed one never reaches)."""

    def __init__(self, step: int, tmp: str, prev: str | None):
        self.step, self.tmp, self.prev = step, tmp, prev

    def __call__(self, stage):
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

        world, rank = _world_rank()
        result, local, failure = None, None, None
        try:
            result = stage()
        except CheckpointException as e:  # DCP's own, raised on every rank, holding the failed ranks' errors
            local = e
            r, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
            failure = (r, getattr(exc, "errno", None), _why(exc))
        except Exception as e:  # noqa: BLE001  (any failure of this rank: agreed on by every rank below)
            local = e
            failure = (rank, getattr(e, "errno", None), _why(e))
        failures = [None] * world
        dist.all_gather_object(failures, failure)
        failed = sorted((f for f in failures if f is not None), key=lambda f: f[0])
        if not failed:
            return result
        if rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        dist.barrier()  # the folder is gone on every rank before any of them raises
        r, no, why = failed[0]
        msg = _failed(self.step, why, self.prev, rank=r)
        raise (OSError(no, msg) if no is not None else RuntimeError(msg)) from local


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary folders are not checkpoints)."""
    root = _ckpt_dir(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step-") and os.path.exists(os.path.join(path, STATE)):
            steps.append((int(name.split("-", 1)[1]), path))
    return [p for _, p in sorted(steps)]


def latest(run_dir: str) -> str | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def damage(path: str) -> str | None:
    """What is wrong with a checkpoint folder (a file missing or of another size than written), or None."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            sizes = json.load(f)["sizes"]
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written"
    return None


def latest_intact(run_dir: str) -> str | None:
    """The newest checkpoint whose files are as written; a damaged newer one is skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        bad = damage(path)
        if bad is None:
            return path
        warnings.warn(f"resume: skipping the damaged checkpoint {path}: {bad}", stacklevel=2)
    return None


def load_state(path: str, map_location=None) -> dict:
    """The trainer state of a checkpoint: tensors, numbers, strings and containers only
    (`weights_only=True`), so that a checkpoint folder from anywhere cannot run code when loaded."""
    file = os.path.join(path, STATE)
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"resume: {file} holds objects other than tensors, numbers and containers; it was refused "
                         "because loading it could run code. Resume only from checkpoints backstream wrote") from e


def restore(path: str, model, optimizer, scheduler=None) -> dict:
    """Load checkpoint `path` into `model` and `optimizer` (and `scheduler` if given), in place, and
    return the rest of the trainer state: step, scheduler, rng, data_position (this rank's when the
    checkpoint was written by as many ranks as there are now, else rank 0's), and `world_size`, the
    number of ranks that wrote it. Either layout, on any number of ranks, single process included;
    under torch.distributed every rank calls it (collective). Full fine-tune or LoRA, as `model` is."""
    world, rank = _world_rank()
    bad = [damage(path)]
    if world > 1:  # a rank whose disk lacks a shard: every rank stops, none waits in dcp.load
        bad = [None] * world
        torch.distributed.all_gather_object(bad, damage(path))
    for r, why in enumerate(bad):
        if why is not None:
            where = f" on rank {r}" if world > 1 else ""
            raise UserError(f"restore: {path} cannot be loaded{where}: {why}. {_damage_hint(path)}")
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    _check_lora(path, model)
    st = load_state(path, map_location="cpu" if sharded(model) else None)  # not every rank onto cuda:0
    if os.path.isdir(os.path.join(path, DCP)):
        _load_sharded(path, model, optimizer)
        if manifest.get("optimizer_empty"):  # saved before its first step: no state, as it was
            optimizer.state.clear()
    else:
        _load_full(path, model, optimizer, st["optimizer"])
    st.pop("optimizer", None)
    ranks = st.pop("ranks", None)
    if ranks is not None and len(ranks) == world:
        st = ranks[rank]
    if scheduler is not None:
        scheduler.load_state_dict(st["scheduler"])
    return {**st, "world_size": manifest.get("world_size", 1)}


def _damage_hint(path: str) -> str:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            world = json.load(f).get("world_size")
    except (OSError, ValueError):
        world = None
    earlier = "resume from an earlier checkpoint (`latest_intact` skips damaged ones)"
    if not world:
        return earlier.capitalize() + "."
    return (f"It was written by {world} ranks, rank r writing dcp/__r_0.distcp: if the ranks wrote to disks of their "
            f"own rather than to a shared one, copy every rank's dcp/ files into {path}/{DCP}/; or {earlier}.")


def _check_lora(path: str, model) -> None:
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.exists(adapter) and not _is_lora(model):
        with open(adapter) as f:
            r = json.load(f).get("r")
        raise UserError(f"restore: {path} holds a LoRA adapter (r={r}) and the model given has no LoRA layers; "
                         f"build the model as the run did (model.lora_r = {r})")
    if not os.path.exists(adapter) and _is_lora(model):
        raise UserError(f"restore: {path} holds full weights and the model given has LoRA layers; build the model "
                         "as the run did (model.lora_r = 0)")


def _check_same_model(path: str, saved: dict, expected: dict, model, may_miss: set = frozenset()) -> None:
    """`saved` and `expected`: name -> shape. A clear error when the checkpoint is of another model."""
    unexpected = sorted(saved.keys() - expected.keys())
    missing = sorted(expected.keys() - saved.keys() - may_miss)
    wrong = sorted(k for k in saved.keys() & expected.keys() if tuple(saved[k]) != tuple(expected[k]))
    if not (unexpected or missing or wrong):
        return
    what = [f"{k} has shape {tuple(saved[k])} there, {tuple(expected[k])} here" for k in wrong[:2]]
    if unexpected:
        what.append(f"{len(unexpected)} tensors the model has no place for ({', '.join(unexpected[:2])}, ...)")
    if missing:
        what.append(f"{len(missing)} of the model's are absent ({', '.join(missing[:2])}, ...)")
    raise UserError(f"restore: {path} holds the weights of another model than the one given: {'; '.join(what)}. "
                     f"It was written from {_describe(path)}; the model given is {_describe(model)}. Build the model "
                     "the run was trained with (its config.toml: model.name, model.lora_r, model.lora_targets)")


def _describe(path_or_model) -> str:
    """What a checkpoint folder or a model holds, for the error messages."""
    if isinstance(path_or_model, str):
        found = {}
        for name in ("config.json", "adapter_config.json"):
            file = os.path.join(path_or_model, name)
            if os.path.exists(file):
                with open(file) as f:
                    found[name] = json.load(f)
        cfg, adapter = found.get("config.json", {}), found.get("adapter_config.json", {})
        arch = (cfg.get("architectures") or ["a model"])[0]
    else:
        model = path_or_model
        adapter = {"r": model.peft_config[model.active_adapter].r} if _is_lora(model) else {}
        base = model.get_base_model() if adapter else model
        cfg, arch = base.config.to_dict(), type(base).__name__.removeprefix("FSDP")  # fully_shard's subclass
    lora = f" with LoRA r={adapter['r']}" if adapter else ""
    if not cfg:  # a LoRA checkpoint holds the adapter's config only
        return f"a LoRA adapter (r={adapter.get('r')}) of {adapter.get('base_model_name_or_path') or 'a base model'}"
    return (f"{arch} ({cfg.get('num_hidden_layers')} layers, hidden size {cfg.get('hidden_size')}, vocabulary "
            f"{cfg.get('vocab_size')}){lora}")


def _hf_names(model) -> tuple[dict, set]:
    """Name in the Hugging Face files -> name in the model's state_dict (LoRA: PEFT's adapter names,
    without the adapter's), and the names PEFT writes only when the vocabulary was resized (the
    embeddings)."""
    sd = model.state_dict(keep_vars=True)
    if not _is_lora(model):
        return {k: k for k in sd}, set()
    from peft import get_peft_model_state_dict  # noqa: PLC0415

    fqn = {id(p): k for k, p in reversed(sd.items())}  # a tied weight: its first name
    adapter = get_peft_model_state_dict(model, state_dict=sd, save_embedding_layers=False)
    more = get_peft_model_state_dict(model, state_dict=sd, save_embedding_layers=True)  # no Hub look-up
    return {k: k if k in sd else fqn[id(p)] for k, p in more.items()}, more.keys() - adapter.keys()


def _load_full(path: str, model, optimizer, optim_state: dict) -> None:
    """A checkpoint one process wrote: the Hugging Face files and the optimizer's state_dict."""
    from safetensors.torch import load_file  # noqa: PLC0415

    lora = _is_lora(model)
    weights = load_file(os.path.join(path, "adapter_model.safetensors" if lora else "model.safetensors"))
    names, optional = _hf_names(model)
    sd = model.state_dict(keep_vars=True)
    written = {id(sd[names[k]]): k for k in weights if k in names}  # save_pretrained writes a tied weight once
    tied = {k: written[id(sd[v])] for k, v in names.items() if k not in weights and id(sd[v]) in written}
    _check_same_model(path, {k: v.shape for k, v in weights.items()}, {k: sd[v].shape for k, v in names.items()},
                      model, may_miss=tied.keys() | optional)
    if not sharded(model):
        if lora:
            from peft import set_peft_model_state_dict  # noqa: PLC0415

            set_peft_model_state_dict(model, weights)
        else:
            missing, unexpected = model.load_state_dict(weights, strict=False)
            assert not unexpected, unexpected
            model.tie_weights()
        optimizer.load_state_dict(optim_state)
        return
    # into a sharded model: every rank reads the whole files and keeps its shards
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_optimizer_state_dict,
        set_state_dict,
    )

    msd = {names[k]: weights[k] for k in weights} | {names[k]: weights[w] for k, w in tied.items()}
    current = get_optimizer_state_dict(model, optimizer)  # the optimizer's parameters by name, in its order
    saved_sizes = [len(g["params"]) for g in optim_state["param_groups"]]
    sizes = [len(g["params"]) for g in current["param_groups"]]
    if saved_sizes != sizes:
        raise UserError(f"restore: {path} holds the state of an optimizer over parameter groups of {saved_sizes} "
                         f"parameters, the optimizer given has {sizes}; build the optimizer as the run did")
    by_id = {}
    for saved_group, group in zip(optim_state["param_groups"], current["param_groups"]):
        by_id.update(zip(saved_group["params"], group["params"]))
    osd = {"state": {by_id[i]: s for i, s in optim_state["state"].items()},
           "param_groups": [{**g, "params": [by_id[i] for i in g["params"]]} for g in optim_state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def _load_sharded(path: str, model, optimizer) -> None:
    """A checkpoint written with DCP, by any number of ranks, into this world (DCP reshards)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: PLC0415

    opts = StateDictOptions(ignore_frozen_params=True, strict=False)  # LoRA: the adapter (what save wrote)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    reader, planner = _safe_io(path)
    meta = reader.read_metadata()
    saved = {k[len("model."):]: m.size for k, m in meta.state_dict_metadata.items() if k.startswith("model.")}
    _check_same_model(path, saved, {k: v.shape for k, v in msd.items()}, model)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": msd, "optimizer": osd}, storage_reader=reader, planner=planner,
                     no_dist=not (torch.distributed.is_available() and torch.distributed.is_initialized()))
    except CheckpointException as e:
        r, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
        if isinstance(exc, ValueError):
            raise exc from None
        hint = (_damage_hint(path) if isinstance(exc, OSError) else "Build the model and the optimizer as the run "
                "did (its config.toml: model.*, optim.*)")
        why = _why(exc).rstrip(".")
        raise UserError(f"restore: reading {path}/{DCP} failed on rank {r}: {why}. {hint}") from None
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=opts)


def _safe_io(path: str):
    """A DCP reader and load planner that, like `load_state`, unpickle only what a checkpoint needs
    (DCP's own `.metadata` pickle and `torch.load` of non-tensor entries would run any code a
    checkpoint folder from anywhere hides): `.metadata` with DCP's metadata classes, torch dtypes and
    sizes only; the other entries `weights_only`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint import metadata as dcp_metadata  # noqa: PLC0415

    folder = os.path.join(path, DCP)

    def refused(what: str) -> ValueError:
        return ValueError(f"restore: {folder} holds {what}; it was refused because loading it could run code. "
                          "Resume only from checkpoints backstream wrote")

    class Unpickler(pickle.Unpickler):
        ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                   ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                   ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

        def find_class(self, module, name):
            if ((module, name) in self.ALLOWED
                    or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
                    or module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type)):
                return super().find_class(module, name)
            raise refused(f"a .metadata that names {module}.{name}")

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata: save never writes it
                raise FileNotFoundError(errno.ENOENT, "no per-rank metadata", folder)
            with open(os.path.join(folder, ".metadata"), "rb") as f:
                meta = Unpickler(f).load()
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = dcp_metadata.StorageMeta()
            meta.storage_meta.load_id = getattr(self, "load_id", None)
            return meta

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                torch.load(value, weights_only=True)  # refuses anything but tensors, numbers and containers
            except pickle.UnpicklingError as e:
                raise refused(f"an entry {read_item.dest_index.fqn} of objects other than tensors, numbers and "
                              "containers") from e
            value.seek(0)
            super().load_bytes(read_item, value)  # the same bytes, now known to be plain data

    return Reader(folder), Planner()


def rng_state() -> dict:
    """The process's random state (the samplers draw from generators of their own: rl/parallel/
    `group_generator`, by the data position; a checkpoint of an older run also holds "sampler", unused)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
