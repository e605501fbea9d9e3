"""The learner's weights to every server of the pool (rl/backends/vllm/pool.py), at every step boundary where
they changed: `sync(model, step)`, one implementation per way they travel (`vllm.weights`, docs/vllm.md,
"Weights every step"):

- `TransferSync` ("transfer"): vLLM's weight-transfer engine (rl/backends/vllm/weights/transfer.py, the servers'
  side engine.py): one process group, the buckets broadcast from rank 0 while every server receives
  and loads them, no file; on one host through shared memory.
- `DiskSync` ("disk"): safetensors in RUN_DIR/vllm/weights-N, reloaded by each server's worker
  (low-bit QaRL weights go this way, compressed as the learner's quantized forward has them).
- `AdapterSync`: a LoRA policy's adapter (files of a few MB), loaded by vLLM in place.
- `ColocatedSync` (`vllm.colocate`, GPUs): the server on the learner's own GPU, asleep while the learner
  trains, its weights handed over by CUDA IPC (vLLM's "ipc" engine), no copy.

Every publish, whatever the way: the requests in flight waited for, aborted or kept (/pause, with
rollout.in_flight), the weights sent, the tokens sampled after labelled with the step that made them,
and every server checked to hold them (rl/backends/vllm/weights/ledger.py: every tensor received with the
fingerprint it was sent with, every parameter loaded) before its prefix cache is reset (cached prompt
K/V are the old weights') and it resumes. A publish that left a server's weights unchanged is an
error naming the server. A server that joined the pool since (restarted) gets the weights at the next
sync even when they did not change.

Under torchrun `sync` is a collective: whether the weights changed is decided over every rank (a
shard may change on one), every rank gathers what is published (a bucket at a time for the transfer:
no collective is interleaved with rank 0's sends), rank 0 publishes, and no rank samples before it
is done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import time

import torch

from backstream.checkpoint import quiet
from backstream.checks import UserError
from backstream.quant.compressed import write_compressed
from backstream.rl.backends.vllm.server import ServerError, on_loopback
from backstream.rl.backends.vllm.weights.ledger import compare, fingerprint
from backstream.rl.backends.vllm.weights.transfer import Group, buckets_of
from backstream.stream import fsdp
from backstream.stream.hf import base_model

ADAPTER = "policy-lora"  # the served name of a LoRA policy's adapter
# what a publish does with the requests in flight: vLLM's /pause mode for each rollout.in_flight
PAUSE_MODES = {"wait": "wait", "resume": "abort", "keep": "keep"}


class PublishError(UserError):
    """A publish that did not leave a server with the learner's weights (the message names which)."""


def base_names(model, state: dict) -> dict:
    """The base model's weights under its own names, from `model`'s state dict: PEFT's prefix and
    wrappers removed (`x.base_layer.weight` is `x.weight`; the adapters' own tensors left out)."""
    base = base_model(model)
    prefix = next(name for name, m in model.named_modules() if m is base)
    prefix = prefix + "." if prefix else ""
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in state.items()
            if k.startswith(prefix) and ".lora_" not in k}


def write_weights(model, out: str, quant=None, tokenizer=None, weights: dict | None = None) -> None:
    """The base model's weights as a folder a server loads (`weights`: its state dict under its own
    names, whole; None: the model's own): low-bit with `quant` (compressed-tensors, as the learner's
    quantized forward has them, from its master weights), else as they are."""
    with quiet():
        if quant is not None:
            write_compressed(model, quant.format, quant.group_size, out, tokenizer)
        else:
            base_model(model).save_pretrained(out, safe_serialization=True, state_dict=weights)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)


def file_fingerprints(folder: str, known: dict | None = None) -> dict[str, tuple[int, float]]:
    """The fingerprint of every tensor in the safetensors files of `folder`, as a server's loader reads
    them (what a disk publish is checked against); a tensor of `known` (what was written, by name) is
    fingerprinted there, the files' headers alone read."""
    from safetensors import safe_open  # noqa: PLC0415

    out, known = {}, known or {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    out[key] = fingerprint(known[key] if key in known else f.get_tensor(key))
    return out


def named_weights(model, rename: dict[str, str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters under their Hugging Face names, each once (a tied head is the embedding,
    which vLLM loads it through): what a transfer sends; `rename`: the served checkpoint's name of each
    (a server of another class: rl/backends/vllm/weights/names.py)."""
    seen, out = set(), []
    for name, p in base_model(model).named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((rename[name] if rename is not None else name, p))
    return out


class WeightSync:
    """What every way of publishing shares (see the module docstring): `pool` (rl/backends/vllm/pool.py),
    `launcher` (what the pool's servers start from: rl/backends/vllm/backend.py `Launcher`), `dp`
    (rl/parallel/), `in_flight` (rollout.in_flight, or "wait"), `folder` (RUN_DIR/vllm: what is
    written), `timeout_s` (vllm.transfer_timeout_s, each phase's)."""

    kind = ""

    def __init__(self, pool, launcher, dp, folder: str, in_flight: str = "wait", timeout_s: float = 300.0,
                 quant=None, rename: dict[str, str] | None = None):
        if in_flight not in PAUSE_MODES:
            raise UserError(f"rollout.in_flight: got {in_flight!r}, expected \"keep\" or \"resume\"")
        self.pool, self.launcher, self.dp, self.folder = pool, launcher, dp, folder
        self.rename = rename  # the servers' names of the policy's tensors (another class: weights/names.py)
        self.in_flight, self.timeout_s, self.quant = in_flight, timeout_s, quant
        self.counter = 0  # the learner's weights, counted: what each server holds is compared with it
        self.seen: tuple | None = None  # this rank's versions of the weights last counted
        self.published = 0
        self.sync_s = 0.0

    @classmethod
    def server_args(cls, cfg) -> list[str]:
        """What a server must be started with to take this way's publishes, beyond what every server the
        run starts has (rl/backends/vllm/server.py `server_args`, which takes transfers); `cfg`: [vllm]."""
        return []

    @classmethod
    def server_env(cls) -> dict[str, str]:
        """What a server's environment must have to take this way's publishes."""
        return {}

    def served_name(self, base: str) -> str:
        """The model name requests use (a LoRA policy's: its adapter's)."""
        return base

    def open(self, model, progress=None) -> None:
        """The first sync (every rank): the pool started from the learner's current weights (a resumed
        run's: its checkpoint's), which its servers then hold, or connected to (servers of yours, which
        get them by the publish that follows)."""
        self.launcher.prepare(model)
        self.pool.open(progress)
        if self.launcher.starts and self.kind != "adapter":
            self.counter, self.seen = self.counter + 1, fsdp.versions(model)
            for m in self.pool.members:
                m.weights = self.counter

    def sync(self, model, step: int, progress=None) -> float:
        """Every server holds `model`'s weights, labelled `step` (see the module docstring); the seconds
        spent publishing (the first time, the pool opened first: `progress(seconds)` while servers start).
        A collective under torchrun."""
        if not self.pool.started:
            self.open(model, progress)
        if self.dp.any(fsdp.versions(model) != self.seen):
            self.counter, self.seen = self.counter + 1, fsdp.versions(model)
        self.pool.agree()
        stale = self.dp.broadcast(any(m.weights != self.counter for m in self.pool.alive()) if self.dp.main else None)
        t = time.perf_counter()
        if stale:
            self.publish_live(model, step)
        elif self.dp.main:
            for m in self.pool.alive():
                if m.label != step:  # a step that changed no weight (every advantage 0): labelled so
                    self.label(m.server, step)
                    m.label = step
        return time.perf_counter() - t if stale else 0.0

    def publish_live(self, model, step: int) -> None:
        """`publish` to the live servers; one found gone meanwhile (it died since `agree`) is marked dead
        and the publish goes again to the others."""
        while True:
            try:
                return self.publish(model, step)
            except ServerError:
                if not self.pool.recheck():
                    raise

    def label(self, server, step: int) -> None:
        server.post("/update_weight_version", {"new_version": str(step)})

    def publish(self, model, step: int) -> None:
        """The weights to every live server (every rank calls it): rank 0 pauses them (`begin`), every
        rank takes part in sending (`deliver`: what is gathered, rank 0 sends), then rank 0 checks that
        each holds them, labels them and resumes them; an error of rank 0's is raised on every rank."""
        members, version = self.pool.alive(), str(step)
        self.published += 1
        try:
            self.dp.on_main(lambda: self.begin(members))
            sent, error = self.deliver(model, members, version)
            self.dp.on_main(lambda: self.finish(members, sent, error, version, step))
        finally:
            if self.dp.main:
                self._all([m.server for m in members], lambda s: s.post("/resume"), quiet=True)

    def begin(self, members) -> None:
        """Rank 0: the requests in flight waited for, aborted or kept (rollout.in_flight)."""
        self._all([m.server for m in members],
                  lambda s: s.post(f"/pause?mode={PAUSE_MODES[self.in_flight]}&clear_cache=false"))

    def deliver(self, model, members, version: str) -> tuple[dict, Exception | None]:
        """Every rank: the weights gathered (`gather`), rank 0 sends them (`send`); rank 0's fingerprints
        of what it sent, and its error (raised after, on every rank: no rank may leave a collective)."""
        payload = self.gather(model)
        if not self.dp.main:
            return {}, None
        try:
            return self.send(model, payload, members, version), None
        except Exception as e:  # noqa: BLE001
            return {}, e

    def finish(self, members, sent: dict, error: Exception | None, version: str, step: int) -> None:
        """Rank 0: every server checked to hold the weights sent, labelled `step`, its prefix cache reset."""
        if error is not None:
            raise error
        problems = [p for m in members for p in self.check(m, sent, version)]
        if problems:
            raise PublishError("a publish of the learner's weights did not land: " + "; ".join(problems) + ". The run "
                               "stopped rather than sample with weights that are not the learner's")
        for m in members:
            self.label(m.server, step)
            m.weights, m.label = self.counter, step
        if self.in_flight != "keep":
            self._all([m.server for m in members], reset_prefix_cache)

    def _all(self, servers, fn, quiet: bool = False) -> None:
        """`fn(server)` on every server at once; the first error raised (none when `quiet`)."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as ex:
            futures = [ex.submit(fn, s) for s in servers]
        for f in futures:
            if f.exception() is not None and not quiet:
                raise f.exception()

    # -- what each way does -------------------------------------------------------------------------
    def gather(self, model):
        """Every rank: what rank 0 sends (whole tensors on rank 0; FSDP's shards gathered)."""
        raise NotImplementedError

    def send(self, model, payload, members, version: str) -> dict:
        """Rank 0: the weights to `members`' servers; the fingerprints of what was sent, by name."""
        raise NotImplementedError

    def check(self, member, sent: dict, version: str) -> list[str]:
        """What is wrong with what `member`'s server holds after the publish ([]: the learner's)."""
        records = member.server.post("/collective_rpc", {"method": "backstream_ledger"})["results"]
        return [p for r in records for p in (
            [f"{member.name}: {r['error']}"] if r.get("error") else compare(sent, r, version, member.name))]

    def close(self) -> None:
        """Delete what was written for the servers (they, or the run, have no more use for it)."""
        if self.dp.main:
            shutil.rmtree(os.path.join(self.folder, "published"), ignore_errors=True)


def reset_prefix_cache(server) -> None:
    """Reset a server's prefix cache, which vLLM refuses (`success: false`) while a request holds blocks:
    an aborted request lets go of them within moments."""
    for _ in range(50):
        if server.post("/reset_prefix_cache") in ({"success": True}, "", None):
            return
        time.sleep(0.1)
    raise PublishError(f"vLLM /reset_prefix_cache: refused for 5 s after a publish (a request still holds cached "
                       f"blocks); {server.where()}")


class DiskSync(WeightSync):
    """Safetensors in RUN_DIR/vllm/published/weights-N (the previous one deleted), reloaded in place by
    each server's worker (rl/backends/vllm/weights/receive.py `backstream_reload`); low-bit weights compressed."""

    kind = "disk"

    def gather(self, model):
        return fsdp.full_state_dict(model)  # every rank; whole on rank 0

    def send(self, model, payload, members, version: str) -> dict:
        sent = reload_from_disk(self, model, payload, members, version,
                                os.path.join(self.folder, "published", f"weights-{self.published}"))
        shutil.rmtree(os.path.join(self.folder, "published", f"weights-{self.published - 1}"), ignore_errors=True)
        return sent


def reload_from_disk(sync: WeightSync, model, state: dict, members, version: str, out: str) -> dict:
    """The whole weights `state` written to `out` (low-bit ones compressed) and reloaded in place by the
    worker of each of `members`' servers (rl/backends/vllm/weights/receive.py `backstream_reload`); what was sent,
    fingerprinted, for `check`. The disk way's publish, and the base under an adapter's first one."""
    shutil.rmtree(out, ignore_errors=True)
    weights = base_names(model, state)
    known = {} if sync.quant is not None else dict(weights)  # (save_pretrained empties the dict it is given)
    write_weights(model, out, sync.quant, weights=weights)
    sent = file_fingerprints(out, known)
    sync._all([m.server for m in members], lambda s: s.post(
        "/collective_rpc", {"method": "backstream_reload", "kwargs": {"path": out, "version": version}}))
    return sent


class AdapterSync(WeightSync):
    """A LoRA policy's adapter (RUN_DIR/vllm/published/weights-N, a few MB), loaded by vLLM in place
    (/v1/load_lora_adapter, load_inplace); each server's worker records the adapter it read (its folder,
    its tensors' fingerprints), which the publish is checked against. A server of your own gets the
    base model's weights too, as a disk publish does, at its first publish: another run may have changed
    its weights since it started (a run whose adapter sat on another run's trained weights sampled
    1.6 off its learner); a server the run started holds the base it was started from."""

    kind = "adapter"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.based: set[int] = set()  # the servers of your own that have the run's base weights

    def served_name(self, base: str) -> str:
        return ADAPTER

    def gather(self, model):
        fresh = self.dp.broadcast([m.index for m in self.pool.alive() if not m.managed and m.index not in self.based]
                                  if self.dp.main else None)
        base = fsdp.full_state_dict(model) if fresh else None  # every rank: a collective
        return fsdp.full_state_dict(model, trainable_only=True), base, fresh

    def send(self, model, payload, members, version: str) -> dict:
        adapter, base, fresh = payload
        if fresh:  # the base first, as a disk publish sends and checks it (its folder gone once loaded)
            to, where = [m for m in members if m.index in fresh], os.path.join(self.folder, "published", "base")
            sent = reload_from_disk(self, model, base, to, version, where)
            shutil.rmtree(where, ignore_errors=True)
            problems = [p for m in to for p in WeightSync.check(self, m, sent, version)]
            if problems:
                raise PublishError("a publish of the base model's weights under the adapter did not land: "
                                   + "; ".join(problems))
            self.based |= set(fresh)
        out = os.path.abspath(os.path.join(self.folder, "published", f"weights-{self.published}"))
        shutil.rmtree(out, ignore_errors=True)
        with quiet():
            model.save_pretrained(out, state_dict=adapter)
        sent = file_fingerprints(out)
        self._all([m.server for m in members], lambda s: s.post(
            "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": out, "load_inplace": True}))
        self.path = out
        shutil.rmtree(os.path.join(self.folder, "published", f"weights-{self.published - 1}"), ignore_errors=True)
        return sent

    def check(self, member, sent: dict, version: str) -> list[str]:
        records = member.server.post("/collective_rpc", {"method": "backstream_adapter"})["results"]
        problems = []
        for r in records:
            if r.get("path") != self.path:
                problems.append(f"{member.name} last loaded the adapter {r.get('path')!r}, not {self.path!r}")
            else:
                problems += compare(sent, {**r, "version": version}, version, member.name)
        return problems


class TransferSync(WeightSync):
    """vLLM's weight-transfer engine (rl/backends/vllm/weights/transfer.py): one group of rank 0 and every worker
    of every live server, joined again when the pool changed; the weights gathered and broadcast a
    bucket at a time; `host`: the learner's address the servers reach; `device`: "gloo" or "nccl"."""

    kind = "transfer"

    def __init__(self, *args, host: str = "127.0.0.1", device: str = "gloo", load: bool = True, **kw):
        super().__init__(*args, **kw)
        self.host, self.device, self.load = host, device, load
        self.shared_memory = True  # on one host, the bytes through /dev/shm (False: over the group, as between hosts)
        self.group: Group | None = None
        self.members: list = []

    def begin(self, members) -> None:
        """Rank 0: the group joined again if the pool changed, a publish failed, or a server is in another
        learner's group since (a server of your own that another run published to), then the pause."""
        if self.group is None or self.members != [m.server.url for m in members] or not self.group.held():
            self._join(members)
        super().begin(members)

    def deliver(self, model, members, version: str) -> tuple[dict, Exception | None]:
        """Every rank gathers bucket after bucket; rank 0 sends each before the next is gathered, so no
        collective is interleaved with its sends (FSDP2's all-gathers beside an NCCL send deadlocked
        TRL, #7103). An error of rank 0's leaves it gathering with the others to the end."""
        named = named_weights(model, self.rename)
        main, sent, error = self.dp.main, {}, None
        meta = ([n for n, _ in named], [p.dtype for _, p in named], [list(p.shape) for _, p in named])
        counts = buckets_of([p.numel() * p.element_size() for _, p in named])  # a DTensor's are its whole's
        with contextlib.ExitStack() as stack:
            send = None
            if main:
                try:
                    send = stack.enter_context(self.group.publishing(*meta, version, self.load))
                except Exception as e:  # noqa: BLE001
                    error = e
            for count in counts:
                part, named = named[:count], named[count:]
                whole = [fsdp.whole(p).detach() for _, p in part]  # every rank: a collective per sharded tensor
                if send is not None and error is None:
                    try:
                        send(whole)
                        sent.update((n, fingerprint(t)) for (n, _), t in zip(part, whole))
                    except Exception as e:  # noqa: BLE001
                        error = e
            if error is not None:  # the phases not waited for: the group closed, joined again next time
                stack.pop_all()
                self.group.close()
                self.group = None
        return sent, error

    def _join(self, members) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        one_host = all(on_loopback(m.server.url) for m in members)
        shm = os.path.join("/dev/shm", f"backstream-{os.getpid()}-weights") if one_host and os.path.isdir(
            "/dev/shm") and self.device == "gloo" and self.shared_memory else ""
        self.group = Group([m.server for m in members], self.host, self.timeout_s, self.device, shm,
                           names=[m.name for m in members])
        self.members = [m.server.url for m in members]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        super().close()


class ColocatedSync(WeightSync):
    """vllm.colocate (GPUs): the run's one server on the learner's own GPU (vllm.gpu_memory_utilization of
    its memory), asleep while the learner trains (`rest`: level 1, its K/V cache freed and its weights
    moved to the host) and woken for the rollout: its weights first, then the learner's new ones handed
    over through vLLM's CUDA IPC engine ("ipc": handles of the learner's own tensors, no copy, pickled
    over HTTP, which the server allows with VLLM_ALLOW_INSECURE_SERIALIZATION=1), then its K/V cache.
    One learner process (a torchrun job's ranks would each need a server of their own)."""

    kind = "colocated"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.asleep, self.joined = False, False

    @classmethod
    def server_args(cls, cfg) -> list[str]:
        return ["--enable-sleep-mode", "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
                "--weight-transfer-config", '{"backend": "ipc"}']  # (the last --weight-transfer-config is vLLM's)

    @classmethod
    def server_env(cls) -> dict[str, str]:
        return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

    def sync(self, model, step: int, progress=None) -> float:
        if self.asleep:
            self.pool.alive()[0].server.post("/wake_up?tags=weights")
        seconds = super().sync(model, step, progress)
        if self.asleep:
            self.pool.alive()[0].server.post("/wake_up?tags=kv_cache")
            self.asleep = False
        return seconds

    def rest(self) -> None:
        """The learner trains: the server sleeps (level 1: its K/V cache freed, its weights on the host)."""
        for m in self.pool.alive():
            m.server.post("/sleep?level=1&mode=wait")
        self.asleep = True

    def gather(self, model):
        return None

    def send(self, model, payload, members, version: str) -> dict:
        import base64  # noqa: PLC0415
        import pickle  # noqa: PLC0415

        from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

        named = [(n, p.detach().contiguous()) for n, p in named_weights(model)]
        device = named[0][1].device
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"
        handles = [{uuid: reduce_tensor(t)[1]} for _, t in named]
        info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
        servers = [m.server for m in members]
        if not self.joined:
            self._all(servers, lambda s: s.post("/init_weight_transfer_engine", {"init_info": {"packed": False}},
                                                timeout=self.timeout_s))
            self.joined = True
        for path, body in (("/start_weight_update", {}), ("/update_weights", {"update_info": info}),
                           ("/finish_weight_update", {"weight_version": version})):
            self._all(servers, lambda s, p=path, b=body: s.post(p, b, timeout=self.timeout_s))
        if device.type == "cuda":  # the server is done with the handles: the learner's tensors are its own again
            torch.cuda.synchronize(device)
            torch.cuda.ipc_collect()
        return {n: fingerprint(t) for n, t in named}
