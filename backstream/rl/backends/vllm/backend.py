"""The server backend over a pool of vLLM servers (rl/backends/vllm/pool.py), token ids in and out, and
`build`, what a run holds of it (rl/backends/base.py `Sampling`).

The sampling side, `ServerBackend` (rl/backends/base.py `Backend`):
- `complete`: one request per group (`n = G`, one server: its prefix cache holds the prompt and its
  images, encoded once there), all of a call's groups in flight at once so the servers batch them,
  each group to the server with the least in flight. A group's request carries a seed drawn from
  its generator (the one the local backend would use), so a resumed run samples what it would have.
- `play`: every episode in a thread of its own, each turn a request whose prompt is exactly the
  episode's ids so far (sampled and inserted tokens, never re-rendered text: the server echoes them
  and they are checked), every turn of one episode on one server (its prefix cache keeps the episode's
  history). Episode k's turn t draws with the t-th of `max_turns` seeds drawn from its generator.
- `round`: an agent session's requests, each after exactly the ids it gives, on one server; a session
  that is over is forgotten by the pool.
The servers hand no K/V (engine.reuse_rollout_kv is refused): the engine runs its prefill.

Who starts the servers, `Launcher`: the pool's hooks, given to it when it is built: server i started
(rank 0) from RUN_DIR/vllm/initial on its own cores or GPUs, or a server of yours connected to and
checked. The weights (rl/backends/vllm/weights/: how they travel is theirs alone) start the pool at
their first sync. The servers' context and K/V cache are checked before the run folder is written
(rl/backends/vllm/context.py), QaRL's kernels asked of them (rl/backends/vllm/alignment.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil

import torch
from torch import Tensor

from backstream.checks import UserError
from backstream.log import log
from backstream.rl.backends.base import Sampling, SamplingParams
from backstream.rl.backends.vllm.alignment import ALIGN_PROBE, Alignment
from backstream.rl.backends.vllm.context import ServerContext, float_dtype
from backstream.rl.backends.vllm.pool import ServerPool, core_lists
from backstream.rl.backends.vllm.requests import ServerRequests, sampling_args
from backstream.rl.backends.vllm.serve import Needs, check_server
from backstream.rl.backends.vllm.server import (
    SERVED_NAME,
    TAKES_TRANSFERS,
    Server,
    VLLMConfig,
    free_port,
    logprobs_mode,
    on_loopback,
    server_args,
)
from backstream.rl.backends.vllm.weights import ENGINE as TRANSFER_ENGINE
from backstream.rl.backends.vllm.weights.names import replacements
from backstream.rl.backends.vllm.weights.sync import (
    AdapterSync,
    ColocatedSync,
    DiskSync,
    TransferSync,
    base_names,
    named_weights,
    write_weights,
)
from backstream.rl.parallel.dataparallel import DataParallel
from backstream.rl.records import Completion, Played, Samples, oldest
from backstream.stream import fsdp
from backstream.stream.hf import base_model


class ServerBackend:
    """The sampling side over `pool` (see the module docstring); `config`: the run's sampling settings;
    `requests`: the generate calls (rl/backends/vllm/requests.py). A `Reporter` too: the oldest weight
    version the step's tokens were sampled with, and the requests each server took."""

    in_process = False

    def __init__(self, config: SamplingParams, eos: list[int], pool: ServerPool, requests: ServerRequests):
        self.config, self.eos, self.pool, self.requests = config, list(eos), pool, requests
        self.metric_keys = ("vllm/weight_version", *pool.metric_keys())

    def _params(self, max_tokens: int) -> dict:
        c = self.config
        return {"max_tokens": max_tokens, "temperature": c.temperature, "stop_token_ids": self.eos, **sampling_args(c)}

    def _generate(self, ids: list[int], params: dict, n: int, seed: int, key=None, pictures=(),
                  where: str = "the prompt") -> list[Completion]:
        return self.pool.request(lambda m: self.requests.generate(m, ids, params, n, seed, self.eos, pictures, where),
                                 key)

    def metrics(self, samples: Samples) -> dict[str, float]:
        return {"vllm/weight_version": oldest(samples.weight_version), **self.pool.metrics()}

    def close(self) -> None:
        """Abort what is in flight (a server of yours goes on serving)."""
        self.requests.abort()

    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None, pictures: list[list] | None = None) -> list[Completion]:
        assert not return_kv, "a server hands no K/V (config.validate refuses engine.reuse_rollout_kv)"
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=g)) for g in generators]
        params, done = self._params(max_tokens), [0]

        def request(j: int) -> list[Completion]:
            out = self._generate(prompts[j].tolist(), params, group_size, seeds[j],
                                 pictures=pictures[j] if pictures else (), where=f"prompt {j} of the step")
            done[0] += 1
            if progress is not None:
                progress(done[0], len(prompts))
            return out

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return [c for group in pool.map(request, range(len(prompts))) for c in group]

    def play(self, starts: list[list[int]], generators: list, turn, budget, max_turns: int,
             return_kv: bool = False) -> list[Played]:
        assert not return_kv, "a server hands no K/V"
        seeds = [torch.randint(0, 2**31 - 1, (max_turns,), generator=g).tolist() for g in generators]
        played = [Played(fed=list(s)) for s in starts]

        def episode(k: int) -> None:
            ids, t, key = list(starts[k]), 0, ("episode", id(played), k)
            try:
                while True:
                    (c,) = self._generate(ids, self._params(budget(len(ids))), 1, seeds[k][min(t, max_turns - 1)],
                                          key=key)
                    played[k].fed = ids + c.ids[:-1]
                    inserted = turn(k, c)
                    if inserted is None:
                        return
                    ids, t = ids + c.ids + list(inserted), t + 1
            finally:
                self.pool.forget(key)

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(128, max(1, len(starts)))) as pool:
            for f in [pool.submit(episode, k) for k in range(len(starts))]:
                f.result()
        return played

    @contextlib.contextmanager
    def round(self, episodes: int):
        """A round's agent sessions: each session's requests on one server, every session the pool still
        remembers forgotten when the round ends."""
        requests = _PoolRound(self)
        try:
            yield requests
        finally:
            for key in list(requests.keys):
                requests.finish(key)


class _PoolRound:
    """A round's requests on the pool (rl/backends/base.py `Requests`)."""

    def __init__(self, backend: ServerBackend):
        self.backend, self.keys = backend, set()

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
        self.keys.add(key)
        b = self.backend
        (c,) = b._generate(list(ids), b._params(max_tokens), 1, seed, key=("session", key))
        return c

    def finish(self, key: str) -> None:
        self.keys.discard(key)
        self.backend.pool.forget(("session", key))


def lora_rank(model) -> int:
    """The largest rank of a PEFT policy's adapters (what the server's --max-lora-rank must hold); 0 without."""
    return max(c.r for c in model.peft_config.values()) if hasattr(model, "peft_config") else 0


class Launcher:
    """How the run's servers come up: the pool's hooks (`start`, `connect`). `cfg`: the run's [vllm];
    `context`: the servers' (rl/backends/vllm/context.py); `args`, `env`: what the way the weights
    travel needs of a server started by the run; `files`: whether it reads the run folder (disk,
    adapter); `needs`: what a server of yours is checked against (the policy's name, dtype, LoRA rank
    and the log-prob mode); `quant`: the run's [quant] when the servers run low-bit weights."""

    def __init__(self, cfg: VLLMConfig, run_dir: str, context: ServerContext, args: list[str], env: dict[str, str],
                 files: bool, needs: Needs, tokenizer, seed: int, dp, quant=None):
        self.cfg, self.run_dir, self.context, self.args, self.env = cfg, run_dir, context, args, env
        self.files, self.needs, self.tok, self.seed, self.dp, self.quant = files, needs, tokenizer, seed, dp, quant
        self.dir = os.path.abspath(os.path.join(run_dir, "vllm"))
        self.model = None  # the policy, once `prepare` ran (a server of yours is checked against it)
        self.start_args: list[str] = []

    @property
    def starts(self) -> bool:
        """Whether the run starts its servers (else they are yours)."""
        return not self.cfg.addresses()

    def prepare(self, model) -> None:
        """Before the pool opens (every rank): rank 0 writes the base model's weights, whole, to
        RUN_DIR/vllm/initial, which the servers start and restart from."""
        self.model = model
        if not self.starts:
            return
        lora = lora_rank(model)
        weights = fsdp.full_state_dict(model)  # every rank: the base model's, whole, on rank 0

        def write():
            initial = os.path.join(self.dir, "initial")
            shutil.rmtree(initial, ignore_errors=True)
            base = base_model(model)
            dtype = float_dtype(weights.values()) if weights else float_dtype(base.parameters())
            length = self.context.length(base.config, dtype)
            write_weights(model, initial, self.quant, self.tok, base_names(model, weights))
            self.start_args = server_args(initial, free_port(), length, str(dtype).removeprefix("torch."),
                                          self.seed, lora, self.needs.mode) + self.args

        self.dp.on_main(write)

    def connect(self, url: str) -> Server:
        """A server of yours, checked again against the model itself (a model passed in code: its own dtype
        and LoRA rank), now that the run folder exists."""
        server = Server.connect(url, self.cfg.request_timeout_s, self.cfg.key())
        needs = self.needs
        if self.model is not None:
            needs = dataclasses.replace(needs, dtype=str(float_dtype(self.model.parameters())).removeprefix("torch."),
                                        lora_rank=lora_rank(self.model))
        info = check_server(server, needs, self.run_dir, files=self.files)
        if info.get("keep") is not None:  # another class than the policy's: what no publish sends stays as served
            server.post("/collective_rpc", {"method": "backstream_keep", "kwargs": {"names": info["keep"]}})
        return server

    def start(self, i: int, progress) -> Server:
        """Rank 0: server i, started from RUN_DIR/vllm/initial (written by `prepare`), on its own cores or
        GPUs; its log RUN_DIR/vllm.log (server 0) or vllm-i.log."""
        log_path = os.path.join(self.run_dir, "vllm.log" if i == 0 else f"vllm-{i}.log")
        args = list(self.start_args)
        args[args.index("--port") + 1] = str(free_port())
        log.info(f"vllm: starting server {i} (its log: {log_path})")
        return Server.start(self.cfg, args, log_path, progress, {**self._devices(i), **self.env})

    def _devices(self, i: int) -> dict[str, str]:
        """Server i's share of the machine: vllm.devices[i], else on a CPU its cores dealt out (with more
        than one server), on GPUs the ones the learner does not use, split evenly."""
        n = self.cfg.servers
        if torch.cuda.is_available():
            if self.cfg.devices:
                return {"CUDA_VISIBLE_DEVICES": self.cfg.devices[i]}
            if self.cfg.colocate:
                return {"CUDA_VISIBLE_DEVICES": str(torch.cuda.current_device())}
            learners = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            free = list(range(learners, torch.cuda.device_count()))
            if len(free) < n:
                raise UserError(f"vllm.servers = {n}: {torch.cuda.device_count()} GPU(s), {learners} for the learner, "
                                f"{len(free)} left; lower vllm.servers, set vllm.devices, or vllm.colocate = true")
            per = len(free) // n
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, free[i * per:(i + 1) * per]))}
        if self.cfg.devices:
            return {"VLLM_CPU_OMP_THREADS_BIND": self.cfg.devices[i]}
        return {"VLLM_CPU_OMP_THREADS_BIND": core_lists(n)[i]} if n > 1 else {}

    def remove(self) -> None:
        """Delete what was written for the servers (they, or a server of yours that loaded it, have no
        more use for it: train.keep_checkpoints alone bounds the disk a run takes)."""
        if self.dp.main:
            shutil.rmtree(self.dir, ignore_errors=True)


def weight_path(v: VLLMConfig, quant, model, infos: list[dict] | None) -> tuple[str, str]:
    """How the learner's weights reach the servers (`vllm.weights` of [vllm] `v`, the run's [quant], the
    policy, the servers' `infos` when they are yours), and why, said at start-up: ("transfer" | "disk"
    | "adapter" | "colocated", the reason)."""
    if v.colocate:
        return "colocated", "vllm.colocate: CUDA IPC to the server on the learner's GPU"
    if lora_rank(model):
        return "adapter", "a LoRA policy publishes its adapter (a few MB) whatever vllm.weights says"
    if quant.enabled:
        if v.weights == "transfer":
            raise UserError(f"vllm.weights = \"transfer\" with quant.rollout = \"{quant.rollout}\": low-bit weights "
                            "are published compressed, as files the servers reload; set vllm.weights = \"disk\" (or "
                            "\"auto\", which takes disk for them)")
        return "disk", f"quant.rollout = \"{quant.rollout}\": the low-bit weights compressed, as files"
    if v.weights == "disk":
        return "disk", "vllm.weights = \"disk\""
    unable = [u for u, i in zip(v.addresses(), infos or []) if i.get("transfer") != TRANSFER_ENGINE]
    if unable:
        if v.weights == "transfer":
            raise UserError(f"vllm.weights = \"transfer\": the server(s) {unable} were started without the weight-"
                            f"transfer engine; start them with `backstream vllm serve` (which adds "
                            f"{' '.join(TAKES_TRANSFERS)}), or set vllm.weights = \"auto\" or \"disk\"")
        return "disk", f"vllm.weights = \"auto\": the server(s) {unable} cannot take a transfer"
    return "transfer", f"vllm.weights = \"{v.weights}\": vLLM's weight-transfer engine, no file"


def build(params: SamplingParams, v: VLLMConfig, *, in_flight: str, max_staleness: int, policy, quant, seed: int,
          tokenizer, eos: list[int], run_dir: str, model, dp=None, processor=None) -> Sampling:
    """What the run samples with on a pool of vLLM servers (`rollout.backend = "vllm"`): its servers
    (started at the first sync, or yours, checked now), the weights the policy and `vllm.weights` call
    for (said), and what they need: `params` the sampling parameters, `v` the run's [vllm],
    `in_flight` / `max_staleness` rollout's, `policy` the run's [model] (a server of yours is checked
    against its name, dtype and LoRA rank), `quant` the run's [quant], `seed` train.seed."""
    dp = dp if dp is not None else DataParallel()
    mode = logprobs_mode(params.top_p, params.top_k)
    in_flight = in_flight if max_staleness else "wait"
    if v.colocate and not torch.cuda.is_available():
        raise UserError("vllm.colocate = true: a server on the learner's own GPU, which this machine does not have "
                        "(no CUDA device); leave it false (the run starts its servers on the CPU's cores)")
    if v.colocate and max_staleness:
        raise UserError("vllm.colocate = true with rollout.max_staleness > 0: the server sleeps while the learner "
                        "trains on the GPU they share, so nothing samples ahead; set rollout.max_staleness = 0")
    if v.colocate and dp.world > 1:
        raise UserError("vllm.colocate = true under torchrun: one server shares one learner's GPU; run one "
                        "process, or start servers of their own (vllm.servers, vllm.devices)")
    context = ServerContext(v)
    needs = Needs(model=policy.name, mode=mode, dtype=policy.dtype, lora_rank=policy.lora_r,
                  architecture=type(base_model(model)).__name__ if model is not None else "",
                  names=tuple((n, tuple(p.shape)) for n, p in named_weights(model)) if model is not None else ())
    infos = None

    def check(files: bool) -> list[dict]:  # yours: checked now, before the run folder (a wrong one refused by name)
        return dp.broadcast(dp.on_main(lambda: [check_server(Server.connect(u, v.request_timeout_s, v.key()), needs,
                                                             run_dir, files) for u in v.addresses()]))

    if v.addresses():
        infos = check(files=False)
    else:
        dp.on_main(v.interpreter)  # no vLLM environment: said now
    kind, why = weight_path(v, quant, model, infos)
    if v.addresses() and kind in ("disk", "adapter"):  # the weights as files: each server must see the run folder
        check(files=True)
    dp.on_main(lambda: log.info(f"vllm: the weights reach the servers by {kind} ({why})"))
    rename = served_names(v, infos, kind, needs)
    low_bit = quant if quant.enabled else None
    way = {"transfer": TransferSync, "colocated": ColocatedSync, "disk": DiskSync, "adapter": AdapterSync}[kind]
    launcher = Launcher(v, run_dir, context, way.server_args(v), way.server_env(), kind in ("disk", "adapter"), needs,
                        processor or tokenizer, seed, dp, low_bit)  # a VLM's processor: the server's runs it
    pool = ServerPool(v.servers, dp, start=launcher.start, connect=launcher.connect, urls=v.addresses(),
                      client_timeout=v.request_timeout_s, client_key=v.key())
    common = dict(pool=pool, launcher=launcher, dp=dp, folder=launcher.dir, in_flight=in_flight,
                  timeout_s=v.transfer_timeout_s, quant=low_bit, rename=rename)
    if kind == "transfer":
        host = v.transfer_host or ("127.0.0.1" if all(on_loopback(u) for u in v.addresses()) else _this_host())
        weights = TransferSync(**common, host=host, device="nccl" if torch.cuda.is_available() else "gloo")
    elif kind == "colocated":
        weights = ColocatedSync(**common)
    else:
        weights = way(**common)
    backend = ServerBackend(params, eos, pool, ServerRequests(weights.served_name(SERVED_NAME), in_flight))
    aligned = ()
    if low_bit is not None and low_bit.aligned:  # QaRL: the servers' kernels, copied by the learner and checked
        aligned = (Alignment(low_bit, lambda: pool.alive()[0].server, len(tokenizer)),)
        context.need_context(ALIGN_PROBE + 1, f"QaRL's alignment check: a prompt of {ALIGN_PROBE} tokens + 1")
    sampling = Sampling(backend=backend, weights=weights, preflight=(context,), aligned=aligned, reporters=(backend,),
                        resting=(weights,) if kind == "colocated" else ())
    # stopped last built first: the requests in flight, the weights' group, the servers, their files
    for stop in (launcher.remove, pool.close, weights.close, backend.close):
        sampling.closing.callback(stop)
    return sampling


def served_names(v: VLLMConfig, infos: list[dict] | None, kind: str, needs: Needs) -> dict | None:
    """The served checkpoint's name of each of the policy's tensors where servers of yours serve another
    class than the policy's (their `infos`: serve.py `check_server`), None where they serve its own; said
    at start-up. All of them must serve one class, and a transfer is the way that sends under those names."""
    maps = [i.get("rename") for i in infos or []]
    if not any(m is not None for m in maps):
        return None
    served = sorted({i.get("architecture", "") for i in infos})
    if len(served) > 1 or any(m != maps[0] for m in maps):
        raise UserError(f"vllm.urls: the servers serve {served}, which name the policy's weights in different ways; "
                        "serve one class on all of them")
    if kind != "transfer":
        raise UserError(f"vllm.weights: the servers serve {served[0]}, which names the policy's ({needs.architecture}) "
                        f"weights its own way, and a publish by {kind} cannot rename them; publish by transfer "
                        "(vllm.weights = \"auto\" or \"transfer\", servers started with `backstream vllm serve`) or "
                        f"serve a folder whose config.json names {needs.architecture}")
    moved = replacements(maps[0])
    keep = infos[0].get("keep") or []
    log.info(f"vllm: the servers serve {served[0]}, the policy is {needs.architecture}: its {len(maps[0])} tensors are "
             f"published under the served names ({', '.join(f'{a} -> {s}' for a, s in moved) or 'the same'}); "
             f"{len(keep)} served tensors no policy tensor has stay as served (e.g. {keep[:2]})")
    return maps[0]


def _this_host() -> str:
    import socket  # noqa: PLC0415

    return socket.gethostbyname(socket.gethostname())
