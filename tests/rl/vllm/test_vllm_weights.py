"""The rollout pool and the weight syncs without vLLM (rl/backends/vllm/pool.py, rl/backends/vllm/weights/sync.py), over
stand-ins of servers that do what a server's worker does with what it is sent (they load the files or the
handles, and keep the ledger of rl/backends/vllm/weights/receive.py), or not:

- routing: a key's requests to one server, a new key to the one with the least in flight; a server found
  gone: its requests go to the others, said once, and with none left the error names every log;
- a disk publish: checked against what each server loaded, a server that kept its old weights an error
  naming it; the files leave with the run (train.keep_checkpoints alone bounds what it leaves);
- vllm.colocate's control plane, in vLLM's order: asleep while the learner trains, woken for the rollout
  (the weights, then the K/V cache), the weights handed over as handles of the learner's own tensors;
  refused on a machine without a GPU.
"""

import base64
import os
import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch
from helpers import tiny
from torch.multiprocessing.reductions import rebuild_tensor

from backstream import config
from backstream.rl.backends import build_backend
from backstream.rl.backends.vllm.pool import Member, ServerPool
from backstream.rl.backends.vllm.server import ServerError, VLLMConfig
from backstream.rl.backends.vllm.weights.ledger import fingerprint
from backstream.rl.backends.vllm.weights.sync import ColocatedSync, DiskSync, PublishError, file_fingerprints
from backstream.rl.parallel.dataparallel import DataParallel


class StandIn:
    """A server's HTTP side as the syncs and the pool use it; `loads`: whether its worker loads what it is
    sent (False: a worker that keeps its old weights); `gone`: it died."""

    proc, log_path = None, None

    def __init__(self, name: str, loads: bool = True):
        self.url, self.loads, self.gone = f"http://127.0.0.1:9/{name}", loads, False
        self.posts: list[str] = []
        self.ledger: dict = {}
        self.lock = threading.Lock()

    def where(self) -> str:
        return f"the stand-in {self.url}"

    def answers(self) -> bool:
        return not self.gone

    def healthy(self) -> bool:
        return not self.gone

    def get(self, path, timeout=None):
        return self.post(path, None, timeout)

    def post(self, path, body=None, timeout=None):
        if self.gone:
            raise ServerError(f"vLLM {path}: no answer; {self.where()}")
        with self.lock:
            self.posts.append(path)
        body = body or {}
        if path == "/collective_rpc" and body["method"] == "backstream_reload":
            if self.loads:
                self.ledger = {"version": body["kwargs"]["version"],
                               "fingerprints": file_fingerprints(body["kwargs"]["path"]), "unloaded": []}
            return {"results": [{}]}
        if path == "/collective_rpc" and body["method"] == "backstream_ledger":
            return {"results": [dict(self.ledger)]}
        if path == "/update_weights" and self.loads:  # vLLM's IPC engine: the handles rebuilt and loaded
            info = body["update_info"]
            handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
            self.ledger = {"version": None, "unloaded": [], "fingerprints": {
                n: fingerprint(rebuild_tensor(*h["cpu"])) for n, h in zip(info["names"], handles)}}
        if path == "/reset_prefix_cache":
            return {"success": True}
        return {}


def _pool(*servers) -> ServerPool:
    pool = ServerPool(len(servers), DataParallel())
    pool.members = [Member(i, s, managed=False) for i, s in enumerate(servers)]
    return pool


def test_a_key_goes_to_one_server_and_a_new_key_to_the_least_busy():
    a, b = StandIn("a"), StandIn("b")
    pool = _pool(a, b)
    release = threading.Event()
    seen: dict = {}

    def hold(member):  # a request that stays in flight until released
        seen.setdefault("held", member.server)
        release.wait(5)
        return member.server

    t = threading.Thread(target=lambda: pool.request(hold, key="episode-1"))
    t.start()
    while "held" not in seen:
        time.sleep(0.01)
    other = pool.request(lambda m: m.server, key="episode-2")  # a new key: the server with nothing in flight
    assert other is not seen["held"]
    assert pool.request(lambda m: m.server, key="episode-2") is other  # its next request: the same server
    release.set()
    t.join()
    assert pool.request(lambda m: m.server, key="episode-1") is seen["held"]
    assert pool.metrics() == {"vllm/requests/0": 2.0, "vllm/requests/1": 2.0, "vllm/servers_alive": 2.0}


def test_a_dead_servers_requests_go_to_the_others_and_none_left_is_an_error(caplog):
    a, b = StandIn("a"), StandIn("b")
    pool = _pool(a, b)
    assert pool.request(lambda m: m.server.post("/x") or m.server, key="k") is a
    a.gone = True  # the key moves with its server's death
    assert pool.request(lambda m: m.server.post("/x") or m.server, key="k") is b
    assert pool.request(lambda m: m.server.post("/x") or m.server) is b
    deaths = [r.message for r in caplog.records if "died or stopped answering" in r.message]
    assert len(deaths) == 1 and "vLLM server 0 (the stand-in http://127.0.0.1:9/a)" in deaths[0]
    assert "it is dropped from the pool" in deaths[0]  # a server of your own is not restarted
    assert pool.metrics()["vllm/servers_alive"] == 1.0
    b.gone = True
    with pytest.raises(ServerError, match=r"every vLLM server of the run died .*server 0 .*server 1 .*--resume"):
        pool.request(lambda m: m.server.post("/x"))


def _model():
    model, tok = tiny(torch.float32)
    return model.eval(), tok


def _step(model):
    with torch.no_grad():  # an "optimizer step": in place, so the weights' versions change
        for p in model.parameters():
            p.add_(0.01)


def test_a_disk_publish_is_checked_and_its_files_leave_with_the_run(tmp_path):
    model, tok = _model()
    a, b = StandIn("a"), StandIn("b")
    pool = _pool(a, b)
    sync = DiskSync(pool, None, DataParallel(), str(tmp_path / "vllm"))
    sync.sync(model, 0)
    folder = tmp_path / "vllm" / "published"
    assert os.listdir(folder) == ["weights-1"] and a.ledger["version"] == "0" == b.ledger["version"]
    assert [p for p in a.posts if not p.startswith("/collective_rpc")] == [
        "/pause?mode=wait&clear_cache=false", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert sync.sync(model, 1) == 0.0 and sync.published == 1  # unchanged: labelled, not published
    _step(model)
    sync.sync(model, 2)
    assert os.listdir(folder) == ["weights-2"]  # the one before: gone
    b.loads = False  # a worker that keeps its old weights (and its old record)
    _step(model)
    with pytest.raises(PublishError, match=r"did not land: vLLM server 1 \(the stand-in http://127.0.0.1:9/b\) "
                       r"recorded publish '2', not '3'.* rather than sample with weights that are not the learner's"):
        sync.sync(model, 3)
    assert b.posts[-1] == "/resume"  # resumed all the same
    sync.close()
    assert not folder.exists()


def test_a_publish_that_left_the_weights_unchanged_names_the_tensors(tmp_path):
    model, tok = _model()
    a = StandIn("a")
    sync = DiskSync(_pool(a), None, DataParallel(), str(tmp_path / "vllm"))
    sync.sync(model, 0)
    stale = dict(a.ledger)
    _step(model)

    class Stale(StandIn):  # labels the new publish, holds the old values
        def post(self, path, body=None, timeout=None):
            out = super().post(path, body, timeout)
            if path == "/collective_rpc" and body["method"] == "backstream_reload":
                self.ledger = {**stale, "version": body["kwargs"]["version"]}
            return out

    sync.pool.members[0].server = Stale("a")
    with pytest.raises(PublishError, match=r"received other values than were sent for \d+ tensors, e\.g\. \['"):
        sync.sync(model, 1)


def test_colocated_control_plane(tmp_path):
    """vllm.colocate in vLLM's order, on stand-ins (a GPU's CUDA IPC handles are a CPU's shared-memory
    ones here): the first sync joins vLLM's IPC engine and publishes, the learner's training puts the
    server to sleep (level 1), the next sync wakes its weights, publishes the step's, then wakes its K/V
    cache; every publish checked against what the server rebuilt from the handles."""
    model, tok = _model()
    a = StandIn("a")
    sync = ColocatedSync(_pool(a), None, DataParallel(), str(tmp_path / "vllm"))
    assert ColocatedSync.server_args(VLLMConfig(gpu_memory_utilization=0.3))[-4:] == [
        "--gpu-memory-utilization", "0.3", "--weight-transfer-config", '{"backend": "ipc"}']
    assert sync.server_env() == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    sync.sync(model, 0)
    routes = [p for p in a.posts if p != "/collective_rpc"]
    assert routes == ["/pause?mode=wait&clear_cache=false", "/init_weight_transfer_engine", "/start_weight_update",
                      "/update_weights", "/finish_weight_update", "/update_weight_version", "/reset_prefix_cache",
                      "/resume"]
    a.posts.clear()
    sync.rest()
    _step(model)
    sync.sync(model, 1)
    routes = [p for p in a.posts if p != "/collective_rpc"]
    assert routes[:2] == ["/sleep?level=1&mode=wait", "/wake_up?tags=weights"]
    assert routes[-1] == "/wake_up?tags=kv_cache"
    assert "/init_weight_transfer_engine" not in routes and "/update_weights" in routes
    a.loads = False  # a server that did not rebuild the handles
    _step(model)
    with pytest.raises(PublishError, match="received other values than were sent"):
        sync.sync(model, 2)


def test_colocate_without_a_gpu_is_refused(tmp_path):
    model, tok = _model()
    cfg = config.load(None, ['rollout.backend="vllm"', "vllm.colocate=true", f'train.output_dir="{tmp_path}"'])
    if torch.cuda.is_available():
        pytest.skip("a GPU machine colocates (bench/gpu_check.sh)")
    with pytest.raises(ValueError, match=r"vllm.colocate = true: a server on the learner's own GPU, which this "
                       r"machine does not have"):
        build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=0, tokenizer=tok,
                      eos=[tok.eos_token_id], run_dir=str(tmp_path), model=model)


class Joining:
    """A stand-in server of one worker for the transfer group (rl/backends/vllm/weights/transfer.py `Group`): it joins
    the learner's group as vLLM's engine does (rank 1, a gloo group over the learner's TCPStore), and
    hangs in the phase `hang` until released."""

    def __init__(self, hang: str):
        self.url, self.name, self.hang = "http://127.0.0.1:9/joining", "vLLM server 0 (the stand-in)", hang
        self.release, self.group = threading.Event(), None

    def get(self, path, timeout=None):
        return {"world_size": 1}

    def post(self, path, body, timeout=None):
        if path == "/init_weight_transfer_engine":
            import torch.distributed as dist

            i = body["init_info"]
            store = dist.PrefixStore(i["prefix"], dist.TCPStore(i["master_address"], i["master_port"], i["world_size"],
                                                                is_master=False, timeout=timedelta(seconds=30)))
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=30)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, 1, i["world_size"], opts)
        elif path == self.hang:
            self.release.wait(30)
        return {}


@pytest.mark.parametrize("hang, words", [
    ("/start_weight_update", r"the weight transfer's /start_weight_update did not finish within "
     r"vllm.transfer_timeout_s = 1 on vLLM server 0 \(the stand-in\); raise it, or look at that server's log"),
    # the worker never takes the bucket: the learner's broadcast overruns, naming the phase still unanswered
    ("/update_weights", r"the weight transfer's broadcast failed .*overran vllm.transfer_timeout_s = 1 \(unanswered: "
     r"/update_weights on vLLM server 0 \(the stand-in\)\); look at that server's log"),
])
def test_a_phase_that_overruns_names_the_phase_the_server_and_the_timeout(tmp_path, hang, words):
    """Every phase of a transfer within vllm.transfer_timeout_s; on expiry the error names the phase, the
    server and the timeout, and the group is shut down with its shared file (nothing of it left)."""
    from backstream.rl.backends.vllm.weights.transfer import Group, TransferError

    server = Joining(hang)
    shm = str(tmp_path / "weights")
    group = Group([server], "127.0.0.1", 1.0, "gloo", shm, names=[server.name])
    t = time.monotonic()
    try:
        with pytest.raises(TransferError, match=words):
            with group.publishing(["w"], [torch.float32], [[4]], "1") as send:
                send([torch.ones(4)])
    finally:
        server.release.set()
    assert time.monotonic() - t < 20 and not os.path.exists(shm)


def test_the_way_weights_travel_is_chosen_and_refused_by_name():
    """`vllm.weights`: auto takes the transfer where every server has the engine, disk for low-bit weights
    and for a server started without the engine; "transfer" there is refused, naming the fix."""
    from backstream.rl.backends.vllm.backend import TRANSFER_ENGINE, weight_path

    model = _model()[0]
    urls = ['vllm.urls=["http://127.0.0.1:1", "http://127.0.0.1:2"]']
    able, unable = {"transfer": TRANSFER_ENGINE}, {}

    def way(*sets, infos=(able, able)):
        cfg = config.load(None, ['rollout.backend="vllm"', *urls, *sets])
        return weight_path(cfg.vllm, cfg.quant, model, list(infos))

    assert way()[0] == "transfer" and way('vllm.weights="disk"')[0] == "disk"
    kind, why = way(infos=(able, unable))
    assert kind == "disk" and "['http://127.0.0.1:2'] cannot take a transfer" in why
    with pytest.raises(ValueError, match=r"vllm.weights = \"transfer\": the server\(s\) \['http://127.0.0.1:2'\] "
                                         r"were started without the weight-transfer engine; start them with "
                                         r"`backstream vllm serve`.*or set vllm.weights = \"auto\" or \"disk\""):
        way('vllm.weights="transfer"', infos=(able, unable))
    assert way('quant.rollout="w8a8"')[0] == "disk"
    with pytest.raises(ValueError, match=r"vllm.weights = \"transfer\" with quant.rollout = \"w8a8\": low-bit weights "
                                         r"are published compressed, as files .*set vllm.weights = \"disk\""):
        way('vllm.weights="transfer"', 'quant.rollout="w8a8"')
