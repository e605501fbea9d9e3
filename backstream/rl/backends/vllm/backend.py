"""The server backend (rl/backends/base.py's protocols) over a pool of vLLM servers (rl/backends/vllm/pool.py),
token ids in and out.

The sampling side, `ServerBackend`:
- `complete`: one request per group (`n = G`, one server: its prefix cache holds the prompt), all of a
  call's groups in flight at once so the servers batch them, each group to the server with the least
  in flight. A group's request carries a seed drawn from its generator (the one the local backend
  would use), so a resumed run samples what it would have.
- `play`: every episode in a thread of its own, each turn a request whose prompt is exactly the
  episode's ids so far (sampled and inserted tokens, never re-rendered text: the server echoes them
  and they are checked), every turn of one episode on one server (its prefix cache keeps the episode's
  history). Episode k's turn t draws with the t-th of `max_turns` seeds drawn from its generator.
- `generate`: one request after exactly the ids, an agent session's requests on one server.
The servers hand no K/V (engine.reuse_rollout_kv is refused): the engine runs its prefill.

The sync side, `ServerSync`: the pool started (rank 0: `vllm.servers` servers from the learner's
weights, or `vllm.urls` checked) at the first sync, the weights published by the run's weight sync
(rl/backends/vllm/weights/: how they travel is its alone), QaRL's kernels and alignment asked of the servers
(rl/backends/vllm/alignment.py), the servers' context checked before the run folder is written.
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
from backstream.rl.backends.base import SamplingParams, no_rounds
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
    on_loopback,
    server_args,
)
from backstream.rl.backends.vllm.weights import ENGINE as TRANSFER_ENGINE
from backstream.rl.backends.vllm.weights.sync import (
    AdapterSync,
    ColocatedSync,
    DiskSync,
    TransferSync,
    base_names,
    write_weights,
)
from backstream.rl.records import Completion, Played, oldest
from backstream.stream import fsdp
from backstream.stream.hf import base_model


class ServerBackend:
    """The sampling side over `pool` (see the module docstring); `config`: the run's sampling settings;
    `requests`: the generate calls (rl/backends/vllm/requests.py)."""

    in_process = False
    round = staticmethod(no_rounds)

    def __init__(self, config: SamplingParams, eos: list[int], pool: ServerPool, requests: ServerRequests):
        self.config, self.eos, self.pool, self.requests = config, list(eos), pool, requests
        self.metric_keys = ("vllm/weight_version", *pool.metric_keys())

    def _params(self, max_tokens: int) -> dict:
        c = self.config
        return {"max_tokens": max_tokens, "temperature": c.temperature, "stop_token_ids": self.eos, **sampling_args(c)}

    def _generate(self, ids: list[int], params: dict, n: int, seed: int, key=None) -> list[Completion]:
        return self.pool.request(lambda m: self.requests.generate(m, ids, params, n, seed, self.eos), key)

    def metrics(self, versions: list[Tensor]) -> dict[str, float]:
        return {"vllm/weight_version": oldest(versions), **self.pool.metrics()}

    def close(self) -> None:
        self.requests.abort()

    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None) -> list[Completion]:
        assert not return_kv, "a server hands no K/V (config.validate refuses engine.reuse_rollout_kv)"
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=g)) for g in generators]
        params, done = self._params(max_tokens), [0]

        def request(j: int) -> list[Completion]:
            out = self._generate(prompts[j].tolist(), params, group_size, seeds[j])
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
            ids, t = list(starts[k]), 0
            while True:
                (c,) = self._generate(ids, self._params(budget(len(ids))), 1, seeds[k][min(t, max_turns - 1)],
                                      key=("episode", id(played), k))
                played[k].fed = ids + c.ids[:-1]
                inserted = turn(k, c)
                if inserted is None:
                    return
                ids, t = ids + c.ids + list(inserted), t + 1

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(128, max(1, len(starts)))) as pool:
            for f in [pool.submit(episode, k) for k in range(len(starts))]:
                f.result()
        return played

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str | None = None) -> Completion:
        (c,) = self._generate(list(ids), self._params(max_tokens), 1, seed, key=("session", key) if key else None)
        return c


def lora_rank(model) -> int:
    """The largest rank of a PEFT policy's adapters (what the server's --max-lora-rank must hold); 0 without."""
    return max(c.r for c in model.peft_config.values()) if hasattr(model, "peft_config") else 0


class ServerSync:
    """The sync side (see the module docstring). `cfg`: the run's [vllm]; `pool`, `weights` (the run's
    weight sync, rl/backends/vllm/weights/sync.py), `context`; `dp`: the run's rl/parallel.py object; `mode`: the
    servers' log-prob mode; `seed`; `policy`: the run's [model] (servers of your own are checked against
    its name, dtype and LoRA before the run folder is written); `quant`: the run's [quant]."""

    def __init__(self, cfg: VLLMConfig, pool: ServerPool, weights, context: ServerContext, dp, run_dir: str,
                 tokenizer, seed: int, mode: str, policy=None, quant=None):
        self.cfg, self.pool, self.weights, self.context, self.dp = cfg, pool, weights, context, dp
        self.run_dir, self.tok, self.seed, self.mode, self.policy = run_dir, tokenizer, seed, mode, policy
        self.quant = quant if quant is not None and quant.enabled else None
        self.dir = os.path.abspath(os.path.join(run_dir, "vllm"))
        self.alignment = Alignment(self.quant, lambda: pool.alive()[0].server, len(tokenizer))
        if self.alignment.probes:  # the servers must take QaRL's start-up probe too
            context.need_context(ALIGN_PROBE + 1, f"QaRL's alignment check: a prompt of {ALIGN_PROBE} tokens + 1")
        self.model = None  # the policy, once the servers started (a restart reads its start-up arguments)
        self.start_args: list[str] = []
        pool.start_one, pool.connect = self._start, self._connect
        pool.client_timeout, pool.client_key = cfg.request_timeout_s, cfg.key()

    def _needs(self, model) -> Needs:
        p = self.policy
        needs = Needs(model=p.name if p is not None else "default", mode=self.mode,
                      dtype=p.dtype if p is not None else "float32", lora_rank=p.lora_r if p is not None else 0)
        if model is not None:  # a model passed in code: its own dtype and LoRA rank
            needs = dataclasses.replace(needs, dtype=str(float_dtype(model.parameters())).removeprefix("torch."),
                                        lora_rank=lora_rank(model))
        return needs

    def _connect(self, url: str) -> Server:
        """A server of yours, checked again against the model itself (a model passed in code: its own dtype
        and LoRA rank), now that the run folder exists."""
        server = Server.connect(url, self.cfg.request_timeout_s, self.cfg.key())
        check_server(server, self._needs(self.model), self.run_dir, files=self.weights.kind in ("disk", "adapter"))
        return server

    def _start(self, i: int, progress) -> Server:
        """Rank 0: server i, started from RUN_DIR/vllm/initial (written by `_open`), on its own cores or
        GPUs; its log RUN_DIR/vllm.log (server 0) or vllm-i.log."""
        log_path = os.path.join(self.run_dir, "vllm.log" if i == 0 else f"vllm-{i}.log")
        args = list(self.start_args)
        args[args.index("--port") + 1] = str(free_port())
        log.info(f"vllm: starting server {i} (its log: {log_path})")
        return Server.start(self.cfg, args, log_path, progress, {**self._devices(i), **self.weights.server_env()})

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

    def _open(self, model, progress) -> None:
        """The pool at the first sync: rank 0 writes the base model's weights once (kept for restarts)
        and starts the servers from them side by side, or connects to yours."""
        self.model = model
        if not self.cfg.addresses():
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
                                              self.seed, lora, self.mode) + self.weights.server_args()

            self.dp.on_main(write)
        self.pool.open(progress)
        if not self.cfg.addresses() and self.weights.kind != "adapter":
            # started from the learner's current weights (a resumed run's: its checkpoint's)
            self.weights.counter, self.weights.seen = self.weights.counter + 1, fsdp.versions(model)
            for m in self.pool.members:
                m.weights = self.weights.counter

    def need_context(self, tokens: int, why: str) -> None:
        self.context.need_context(tokens, why)

    def check(self, model) -> None:
        self.context.check(model)

    def view(self, model):
        return contextlib.nullcontext()  # what is published is gathered by the weight sync, a bucket at a time

    def sync(self, model, step: int, progress=None) -> float:
        if not self.pool.started:
            self._open(model, progress)
        return self.weights.sync(model, step)

    def idle(self) -> None:
        self.weights.idle()

    def kernels(self) -> dict[str, str]:
        return self.alignment.kernels()

    def check_aligned(self, model) -> None:
        self.alignment.check_aligned(model)

    def close(self) -> None:
        """Stop the servers the run started, and delete what was written for them (they, or a server of
        yours that loaded it, have no more use for it: train.keep_checkpoints alone bounds the disk a
        run takes)."""
        self.weights.close()
        self.pool.close()
        if self.dp.main:
            shutil.rmtree(self.dir, ignore_errors=True)


def weight_path(cfg, model, infos: list[dict] | None) -> tuple[str, str]:
    """How the learner's weights reach the servers (`vllm.weights`, the policy, the servers' `infos`
    when they are yours), and why, said at start-up: ("transfer" | "disk" | "adapter" | "colocated",
    the reason)."""
    v, quant = cfg.vllm, cfg.quant
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


def build(cfg, tokenizer, eos: list[int], run_dir: str, dp, model) -> tuple[ServerBackend, ServerSync]:
    """The two sides of the run's server backend (`rollout.backend = "vllm"`): its servers (started at the
    first sync, or yours, checked now), the weight sync the policy and `vllm.weights` call for, said."""
    from backstream.rl.backends.vllm.server import logprobs_mode  # noqa: PLC0415

    v = cfg.vllm
    mode = logprobs_mode(cfg.rollout.top_p, cfg.rollout.top_k)
    in_flight = cfg.rollout.in_flight if cfg.rollout.max_staleness else "wait"
    if v.colocate and not torch.cuda.is_available():
        raise UserError("vllm.colocate = true: a server on the learner's own GPU, which this machine does not have "
                        "(no CUDA device); leave it false (the run starts its servers on the CPU's cores)")
    if v.colocate and cfg.rollout.max_staleness:
        raise UserError("vllm.colocate = true with rollout.max_staleness > 0: the server sleeps while the learner "
                        "trains on the GPU they share, so nothing samples ahead; set rollout.max_staleness = 0")
    context = ServerContext(v)
    needs = Needs(model=cfg.model.name, mode=mode, dtype=cfg.model.dtype, lora_rank=cfg.model.lora_r)
    infos = None

    def check(files: bool) -> list[dict]:  # yours: checked now, before the run folder (a wrong one refused by name)
        return dp.broadcast(dp.on_main(lambda: [check_server(Server.connect(u, v.request_timeout_s, v.key()), needs,
                                                             run_dir, files) for u in v.addresses()]))

    if v.addresses():
        infos = check(files=False)
    else:
        dp.on_main(v.interpreter)  # no vLLM environment: said now
    kind, why = weight_path(cfg, model, infos)
    if v.addresses() and kind in ("disk", "adapter"):  # the weights as files: each server must see the run folder
        check(files=True)
    dp.on_main(lambda: log.info(f"vllm: the weights reach the servers by {kind} ({why})"))
    pool = ServerPool(v.servers, dp, urls=v.addresses())
    folder = os.path.abspath(os.path.join(run_dir, "vllm"))
    quant = cfg.quant if cfg.quant.enabled else None
    common = dict(pool=pool, dp=dp, folder=folder, in_flight=in_flight, timeout_s=v.transfer_timeout_s, quant=quant,
                  tokenizer=tokenizer)
    if kind == "transfer":
        host = v.transfer_host or ("127.0.0.1" if all(on_loopback(u) for u in v.addresses()) else _this_host())
        weights = TransferSync(**common, host=host, device="nccl" if torch.cuda.is_available() else "gloo")
    elif kind == "colocated":
        if dp.world > 1:
            raise UserError("vllm.colocate = true under torchrun: one server shares one learner's GPU; run one "
                            "process, or start servers of their own (vllm.servers, vllm.devices)")
        weights = ColocatedSync(**common, memory=v.gpu_memory_utilization)
    else:
        weights = {"disk": DiskSync, "adapter": AdapterSync}[kind](**common)
    sync = ServerSync(v, pool, weights, context, dp, run_dir, tokenizer, cfg.train.seed, mode, cfg.model, cfg.quant)
    requests = ServerRequests(weights.served_name(SERVED_NAME), in_flight)
    return ServerBackend(cfg.rollout, eos, pool, requests), sync


def _this_host() -> str:
    import socket  # noqa: PLC0415

    return socket.gethostbyname(socket.gethostname())
