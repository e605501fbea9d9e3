"""A server of your own (issue 32, items 3 and 4): `backstream vllm serve` starts a server with what a
run needs, and a run connecting to a server (`vllm.url`) checks it before its run folder is written,
refusing one that cannot serve it with the command that starts a right one.

Without a server: the url's form and the API key off loopback (VLLMConfig), the serve command's line
and environment, the CLI's options, a server without dev routes (a stand-in HTTP server). Against real
servers (marked vllm; one `backstream vllm serve` for the module, one vLLM started the plain way): a
run trains on the served one with `mismatch/kl` ~1e-13; wrong key, log-prob mode, LoRA, dtype, a run
folder the server cannot see, routes open without the key and a missing worker extension are refused
by name, with the command."""

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import KEY, no_run_written, run_cfg, vllm_python
from vllm_helpers import Served

from backstream import trainer
from backstream.checks import UserError
from backstream.cli import cmd_vllm_serve, parse, serve_args
from backstream.default_model import DEFAULT_MODEL_DIR
from backstream.rl.backends.vllm.serve import Needs, ServeArgs, check_server, command
from backstream.rl.backends.vllm.server import Server, VLLMConfig, ext_path, free_port, server_env


@pytest.mark.parametrize("url, words", [
    ("localhost:8000", "no http:// or https:// scheme"),
    ("127.0.0.1:8000", "no http:// or https:// scheme"),
    ("ftp://127.0.0.1:8000", "no http:// or https:// scheme"),
    ("http://:8000", "no http:// or https:// scheme and host"),
    ("http://127.0.0.1:80000", "out of range"),
    ("http://127.0.0.1:port", "Port could not be cast"),
    ("http://127.0.0.1:8000/?x=1", "no query"),
])
def test_a_url_without_the_form_of_a_servers_address_is_refused(url, words):
    # "localhost:8000" used to reach the run and be told that no vLLM server answers there
    with pytest.raises(UserError, match=rf"vllm.url = '{re.escape(url)}'.*{words}.*http://HOST:PORT"):
        VLLMConfig(url=url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/", "https://[::1]:8000",
                                 "http://127.0.0.2:8000/prefix"])
def test_urls_on_loopback_need_no_key(url):
    VLLMConfig(url=url)


def test_a_url_off_loopback_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(UserError, match="vllm.api_key: vllm.url = 'http://10.1.2.3:8000' is off loopback.*--api-key"):
        VLLMConfig(url="http://10.1.2.3:8000")
    with pytest.raises(UserError, match="vllm.api_key"):
        VLLMConfig(url="http://gpu-box:8000")
    assert VLLMConfig(url="http://gpu-box:8000", api_key=KEY).key() == KEY
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # the variable vLLM's server reads too
    assert VLLMConfig(url="http://gpu-box:8000").key() == "from-env"


def test_a_url_with_no_server_is_refused_before_the_run_folder(tmp_path):
    # it used to be found at the first rollout, after the run folder was written
    cfg = run_cfg(tmp_path, "run", 'rollout.backend="vllm"', 'vllm.url="http://127.0.0.1:9"')
    with pytest.raises(UserError, match="vllm.url: no vLLM server answers at http://127.0.0.1:9/health.*vllm serve"):
        trainer.train(cfg)
    assert no_run_written(tmp_path / "run")


def test_the_serve_command_starts_what_a_run_needs(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    argv, env = ServeArgs(model="default", port=8123, api_key=KEY, python=sys.executable, top_p=0.8).command()
    assert argv[:3] == [sys.executable, "-m", "backstream.rl.backends.vllm.launch"]  # vLLM's server, routes guarded
    args = argv[3:]

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--model") == str(DEFAULT_MODEL_DIR) and value("--served-model-name") == "policy"
    assert value("--host") == "127.0.0.1" and value("--port") == "8123" and value("--dtype") == "float32"
    assert value("--logprobs-mode") == "raw_logprobs"  # top_p < 1: the learner's log-probs are the raw ones
    assert value("--worker-extension-cls") == "backstream.rl.backends.vllm.worker_ext.WorkerExtension"
    assert "--no-enable-chunked-prefill" in args and value("--max-model-len") == "4096"  # the model's context
    assert value("--max-num-batched-tokens") == "4096" and "--enable-lora" not in args
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ext_path() and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_API_KEY"] == KEY and KEY not in " ".join(argv)  # not on a command line `ps` shows
    # the run's own server's environment is the same function's
    assert {k: v for k, v in env.items() if k != "VLLM_API_KEY"} == server_env(1)
    argv, env = ServeArgs(model="default", python=sys.executable, lora_rank=16, max_model_len=512, top_k=5,
                          logprobs_mode="processed_logprobs").command()
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in argv
    assert argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"  # chosen outright
    assert "VLLM_API_KEY" not in env


def test_the_serve_command_refuses_the_network_without_a_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(UserError, match="--host 0.0.0.0: off loopback the server needs an API key"):
        ServeArgs(model="default", host="0.0.0.0", python=sys.executable).command()
    argv, env = ServeArgs(model="default", host="0.0.0.0", python=sys.executable, api_key=KEY).command()
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and env["VLLM_API_KEY"] == KEY
    with pytest.raises(UserError, match="--python /no/such/python does not exist; run `backstream vllm setup`"):
        ServeArgs(model="default", python="/no/such/python").command()


def test_the_cli_passes_its_options_and_vllms_own():
    args = parse(["vllm", "serve", "default", "--port", "8124", "--top-p", "0.8", "--lora-rank", "4",
                  "--", "--max-num-seqs", "64", "--enforce-eager"])
    assert args.fn is cmd_vllm_serve
    a = serve_args(args)
    assert (a.model, a.port, a.mode(), a.lora_rank) == ("default", 8124, "raw_logprobs", 4)
    assert a.extra == ("--max-num-seqs", "64", "--enforce-eager")
    assert a.url() == "http://127.0.0.1:8124"


def test_the_refusals_command_is_the_runs():
    needs = Needs(model="Qwen/Qwen3-0.6B", mode="raw_logprobs", dtype="bfloat16", lora_rank=8)
    assert command("http://gpu-box:9000", needs, True) == (
        "backstream vllm serve Qwen/Qwen3-0.6B --host 0.0.0.0 --port 9000 --dtype bfloat16 --logprobs-mode "
        "raw_logprobs --lora-rank 8 --api-key KEY   (KEY: the run's vllm.api_key)")
    assert command("http://127.0.0.1:8000", Needs(), False) == \
        "backstream vllm serve default --host 127.0.0.1 --port 8000"


class _NoDevRoutes(http.server.BaseHTTPRequestHandler):
    """What vLLM answers when started without VLLM_SERVER_DEV_MODE and --served-model-name: /health,
    /v1/models (the model under its path), 404 else."""

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._answer(200, {})
        if self.path == "/v1/models":
            return self._answer(200, {"data": [{"id": "/models/qwen"}]})
        self._answer(404, {"detail": "Not Found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(404, {"detail": "Not Found"})

    def log_message(self, *args):
        pass


def test_a_server_without_dev_routes_or_the_served_name_is_refused_with_the_command(tmp_path):
    # such a server used to fail at the run's first publish with a bare "/pause?mode=wait: HTTP 404"
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoDevRoutes)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(UserError, match=rf"the server at {url} cannot serve this run: it serves "
                           r"\['/models/qwen'\], not \"policy\" \(--served-model-name\); its token-in, token-out "
                           r"route /inference/v1/generate is off \(--enable-scale-out\).*; it has no weight-reload "
                           r"routes.*VLLM_SERVER_DEV_MODE=1.*\n  backstream vllm serve default --host 127.0.0.1 "
                           rf"--port {httpd.server_address[1]}\n"):
            check_server(Server.connect(url, 10), Needs(), str(tmp_path / "run"))
    finally:
        httpd.shutdown()
    assert not os.listdir(tmp_path)  # the probe is gone


# --- against real servers -------------------------------------------------------------------------

def _vllm_python():
    return vllm_python()


def _wait_health(url, proc, seconds=300):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        assert proc.poll() is None, "the server exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise AssertionError(f"no /health at {url} within {seconds} s")


@pytest.fixture
def served(vllm_served):
    """The session's first `backstream vllm serve default` server (conftest.py): (url, its command's process)."""
    return vllm_served.urls[0], vllm_served.procs[0]


def _status(url, path, key=None, method="GET"):
    req = urllib.request.Request(url + path, data=b"{}" if method == "POST" else None, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
                                 if key else {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _run(tmp_path, name, url, *extra):
    return run_cfg(tmp_path, name, 'model.dtype="float32"', 'rollout.backend="vllm"', 'data.task="arith"',
                   "data.num_examples=64", f'vllm.url="{url}"', *extra)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_trains_on_a_server_started_with_backstream_vllm_serve(served, tmp_path):
    url, _ = served
    # the key guards every route but /health, the weight-reload ones included (vLLM's own guards /v1 only)
    assert _status(url, "/health") == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/collective_rpc"), ("POST", "/pause"),
                         ("GET", "/server_info"), ("GET", "/is_paused")):
        assert _status(url, path, method=method) == 401, path
    assert _status(url, "/is_paused", KEY) == 200
    run = trainer.train(_run(tmp_path, "run", url, f'vllm.api_key="{KEY}"'))
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    kls = [r["mismatch/kl"] for r in rows if r["batch/zero_adv_frac"] < 1]
    print("mismatch/kl", kls, "versions", [r["vllm/weight_version"] for r in rows])
    assert [r["step"] for r in rows] == [1, 2, 3] and kls and all(k < 1e-9 for k in kls)
    assert rows[-1]["vllm/weight_version"] >= 1  # published every step that changed the weights


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("extra, words", [
    ([f'vllm.api_key="not-{KEY}"'], "refused vllm.api_key \\(HTTP 401\\): set it to the key the server was started"),
    ([], "refused a request without a key \\(HTTP 401\\): set vllm.api_key"),
    # the server reports processed log-probs, renormalised after top-p: mismatch/kl 1.3e-2, silently
    ([f'vllm.api_key="{KEY}"', "rollout.top_p=0.8"],
     "it reports log-probs as processed_logprobs, and this run needs raw_logprobs.*\n  backstream vllm serve default "
     "--host 127.0.0.1 --port \\d+ --logprobs-mode raw_logprobs --api-key KEY"),
    ([f'vllm.api_key="{KEY}"', "model.lora_r=16"],
     "the policy's LoRA rank 16 is above the server's --max-lora-rank 8.*--lora-rank 16 --api-key KEY"),
    ([f'vllm.api_key="{KEY}"', 'model.dtype="bfloat16"'],
     "it runs float32, the policy's weights are bfloat16.*--dtype bfloat16"),
])
def test_a_server_that_cannot_serve_the_run_is_refused_before_the_run_folder(served, tmp_path, monkeypatch, extra,
                                                                             words):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    url, _ = served
    with pytest.raises(UserError, match="(?s)" + words):
        trainer.train(_run(tmp_path, "bad", url, *extra))
    assert no_run_written(tmp_path / "bad")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_folder_the_server_cannot_see_is_refused(served, tmp_path, monkeypatch):
    """Weights that reach the server as files (vllm.weights = "disk", a LoRA adapter) are paths under the
    run folder: a server on another host must see it at the same path. /proc/self/cwd is such a path: it
    names the test's cwd here, the server's there. A transfer needs no shared folder."""
    from backstream.default_model import load_default

    url, _ = served
    model, tok = load_default()
    monkeypatch.chdir(tmp_path)
    disk = ['rollout.backend="vllm"', f'vllm.url="{url}"', f'vllm.api_key="{KEY}"', 'vllm.weights="disk"']
    with pytest.raises(UserError, match=r"cannot read the file /proc/self/cwd/\.backstream-probe-\w+ the run wrote "
                       r"\(FileNotFoundError.*must be visible to the server at the same path"):
        Served(tok, "/proc/self/cwd/run", model, *disk)
    assert not os.listdir(tmp_path)  # the probe is gone, and no run folder was written
    Served(tok, str(tmp_path / "run"), model, *disk).close()  # the same path: accepted
    Served(tok, "/proc/self/cwd/run", model, *disk[:-1]).close()  # by transfer: accepted


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_started_the_plain_way_is_refused_with_the_command(tmp_path):
    """vLLM started as its docs say, with the dev routes, the served name and --api-key but without
    `backstream vllm serve`: no worker extension (a publish could not reload the weights), and its
    weight-reload routes answer without the key."""
    port = free_port()
    env = {**server_env(1), "PYTHONPATH": ""}
    env.pop("VLLM_API_KEY", None)
    log = open(tmp_path / "vllm.log", "w")
    proc = subprocess.Popen([_vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(DEFAULT_MODEL_DIR), "--served-model-name", "policy", "--port", str(port),
                             "--max-model-len", "256", "--dtype", "float32", "--enforce-eager",
                             "--logprobs-mode", "processed_logprobs", "--api-key", KEY], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        with pytest.raises(UserError) as e:
            check_server(Server.connect(url, 60, KEY), Needs(), str(tmp_path / "run"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    message = str(e.value)
    print(message)
    assert "answer without the API key" in message and "its worker has no backstream_info" in message
    assert "prefills prompts in chunks" not in message  # unknown without the extension
    assert f"\n  backstream vllm serve default --host 127.0.0.1 --port {port} --api-key KEY" in message
