"""The server's side of a publish, inside the vLLM worker (vLLM's environment; the worker extension,
rl/backends/vllm/worker_ext.py, imports it, which registers the engine before vLLM creates it).

- `BackstreamEngine`, vLLM's weight-transfer engine named "backstream" (`--weight-transfer-config
  '{"backend": "backstream"}'`, vllm/distributed/weight_transfer/factory.py): the learner's rank 0 and
  every worker of every server form one process group of torch's own (a TCPStore and a
  ProcessGroupGloo on CPU, ProcessGroupNCCL on GPUs, made directly, not through init_process_group),
  and the learner broadcasts the weights bucket by bucket while vLLM's four phases run on each server:
  /init_weight_transfer_engine (join the group), /start_weight_update (vLLM's layerwise reload),
  /update_weights (receive every bucket and hand it to the model's `load_weights`; it returns once all
  of them are loaded), /finish_weight_update (finalize). Why torch's own groups: the learner's
  environment has no vLLM (whose transformers is older than the project's), and vLLM's NCCL engine is
  a no-op off CUDA that reports success (vLLM PR #57022), so it cannot be the CPU path.
  On one host (`shm_path`) the bytes go through a shared-memory file the learner writes and the
  worker reads in place, the group carrying an 8-byte signal per bucket: loopback TCP alone moved
  2.4 GB in 2.6-3.1 s here, a 0.6B model's whole budget.
- `WorkerWeights`, the worker extension's methods: `backstream_reload(path, version)` (the disk path:
  the same load, from safetensors), `backstream_group()` (the group it is in) and
  `backstream_ledger()`, what the last publish loaded
  (rl/backends/vllm/weights/ledger.py), which the learner checks after every publish: vLLM itself answers 200
  to a transfer that loaded nothing and keeps serving the old weights.

On a CPU server, after any load: a tied LM head is re-tied to the embedding and its packed GEMM copy
rebuilt (vLLM's load skips `lm_head.*` and the head kept sampling with its old packed copy: 0.196 off
the new weights); the embedding's own GEMM pack, which only the tied head would use, is skipped
during the load (1.8 s of a 0.6B model's publish); and the worker, which vLLM pins to one core, may use
every core while it receives. An exception out of `finish_weight_update` would leave the worker's
update session open for good (every later /start_weight_update refused), so what went wrong is
recorded in the ledger instead, for the learner to raise.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from backstream.rl.backends.vllm.weights import ENGINE as BACKEND
from backstream.rl.backends.vllm.weights.ledger import fingerprint

LAST: dict = {}  # the ledger of this worker's last publish, by whichever path (`WorkerWeights.backstream_ledger`)
# the checkpoint this server started from (a disk reload points the model config at the run's folder)
STARTED_FROM: dict = {}
# the parameters filled from that checkpoint by `backstream_keep`: the served tensors no policy tensor
# maps to (a composite's vision tower under a text policy: rl/backends/vllm/weights/names.py)
KEPT: set = set()
JOINED: dict = {}  # the transfer group this worker is in: its name (`WorkerWeights.backstream_group`)

try:  # inside vLLM's environment; the learner never imports this module
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
except ImportError:  # pragma: no cover  (another vLLM: the disk path still works)
    WeightTransferEngine = WeightTransferInitInfo = WeightTransferUpdateInfo = object
    WeightTransferEngineFactory = None


def _tied(model_config) -> bool:
    return bool(getattr(model_config.hf_config.get_text_config(), "tie_word_embeddings", False))


def retie_head(model, model_config) -> int:
    """CPU: a tied LM head re-tied to the embedding and its packed GEMM copy rebuilt; 1 if it was."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415

    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not _tied(model_config) or not hasattr(head, "weight"):
        return 0
    head.weight = embed.weight
    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return 1


class Ledger:
    """What one publish handed to `load_weights` (fingerprints by name) and what it said it loaded."""

    def __init__(self, version: str):
        self.version, self.fingerprints, self.loaded = version, {}, set()

    def feed(self, weights):
        for name, t in weights:
            self.fingerprints[name] = fingerprint(t)
            yield name, t

    def record(self) -> dict:
        return {"version": self.version, "fingerprints": self.fingerprints}


@contextlib.contextmanager
def recording(model, ledger: Ledger):
    """`model.load_weights` records into `ledger` while inside (the disk reload calls it itself)."""
    load = model.load_weights

    def load_weights(weights):
        loaded = load(ledger.feed(weights))
        ledger.loaded |= set(loaded or ())
        return loaded

    model.load_weights = load_weights
    try:
        yield
    finally:
        del model.load_weights


def unloaded(model, model_config, loaded: set[str]) -> list[str]:
    """The model's parameters no `load_weights` call of the publish loaded (they keep their old values);
    a tied head is loaded through the embedding. A quantized model's are not named one to one by what it
    loads (vLLM checks them only without quantization too): the fingerprints of what it was handed
    stand alone there. A server that serves adapters wraps its layers (`x.base_layer.weight` is loaded as
    `x.weight`, as vLLM's own reload names it)."""
    if model_config.quantization is not None:
        return []
    params = {n.replace(".base_layer.", ".") for n, _ in model.named_parameters()}
    if _tied(model_config):
        params.discard("lm_head.weight")
    return sorted(params - loaded - KEPT)


def _checkpoint_files(runner) -> list[str]:
    """The safetensors files of the checkpoint the server started from, as vLLM's loader finds them
    (a folder, or the Hub cache of a model id)."""
    from vllm.model_executor.model_loader import get_model_loader  # noqa: PLC0415

    config = runner.vllm_config.model_config
    model, revision = STARTED_FROM.get("model", config.model), STARTED_FROM.get("revision", config.revision)
    _, files, safetensors, *_ = get_model_loader(runner.vllm_config.load_config)._prepare_weights(
        model, None, revision, False, None)
    if not safetensors:
        raise ValueError(f"the checkpoint {model} is not in safetensors files: its tensors' names are not read")
    return files


@contextlib.contextmanager
def _every_core():
    """The worker's threads (gloo's receive thread among them) may use every core meanwhile: vLLM pins
    the worker to one, where the receive and the load would take turns."""
    saved = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            saved[int(tid)] = os.sched_getaffinity(int(tid))
            os.sched_setaffinity(int(tid), set(range(os.cpu_count() or 1)))
    except (OSError, AttributeError):
        pass
    try:
        yield
    finally:
        for tid, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def _no_embedding_pack(model, model_config):
    """A tied CPU model: the embedding's GEMM pack (which only the tied head would run, and which
    `retie_head` rebuilds once) is skipped during the load."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    method = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "quant_method", None)
    if not (current_platform.is_cpu() and _tied(model_config) and method is not None
            and "process_weights_after_loading" not in method.__dict__):
        yield
        return
    method.process_weights_after_loading = lambda layer: None
    try:
        yield
    finally:
        del method.process_weights_after_loading


@dataclass(kw_only=True)
class InitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    prefix: str = "backstream"
    device: str = "gloo"  # "gloo" (CPU tensors) or "nccl" (CUDA)
    shm_path: str = ""  # one host: the bytes through this shared file, the group carries the signals
    bind: str = ""  # the address this worker's gloo device binds ("": its host's own)


@dataclass(kw_only=True)
class UpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int]  # tensors per bucket, in order
    version: str
    load: bool = True  # False: receive and drop (the test that a publish which did not land is caught)

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or sum(self.buckets) != n:
            raise ValueError(f"backstream update_info: {n} names, {len(self.dtype_names)} dtypes, {len(self.shapes)} "
                             f"shapes, buckets of {sum(self.buckets)} tensors")


class BackstreamEngine(WeightTransferEngine):
    """The learner's rank 0 broadcasts buckets to every worker of every server (see the module
    docstring); each bucket is loaded while the next travels."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.shm_path, self.shm = "", None
        self.ledger: Ledger | None = None

    def init_transfer_engine(self, info: InitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        timeout = timedelta(seconds=info.timeout_s)
        store = dist.PrefixStore(info.prefix, dist.TCPStore(info.master_address, info.master_port, info.world_size,
                                                            is_master=False, timeout=timeout))
        if info.device == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, info.world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=info.bind) if info.bind
                             else dist.ProcessGroupGloo.create_default_device()]
            self.group = dist.ProcessGroupGloo(store, rank, info.world_size, opts)
        self.cuda = info.device == "nccl"
        self.shm_path, self.shm = info.shm_path, None
        JOINED["prefix"] = info.prefix

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: PLC0415

        initialize_layerwise_reload(self.model)
        self.ledger = Ledger("")

    def update_weights(self, update_info: dict) -> None:
        # the base class would then call torch.accelerator.synchronize(), which raises on a CPU-only torch
        self.receive_weights(self.parse_update_info(update_info))
        if self.cuda:
            torch.cuda.synchronize()

    def receive_weights(self, info: UpdateInfo) -> None:
        if self.group is None or self.ledger is None:
            raise RuntimeError("backstream engine: /init_weight_transfer_engine and /start_weight_update first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check  # noqa: PLC0415

        self.ledger.version = info.version
        metas = [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]
        chunks, i = [], 0
        for count in info.buckets:
            chunks.append(metas[i:i + count])
            i += count
        with _every_core(), _no_embedding_pack(self.model, self.model_config), disable_mtp_completeness_check(), \
                recording(self.model, self.ledger):
            for buf, chunk in self._buckets(chunks):
                if info.load:
                    self.model.load_weights(_views(buf, chunk))

    def _buckets(self, chunks):
        """Each bucket's bytes as they arrive: over the group (the next one travels while this one is
        loaded; a fresh buffer each, since the layerwise loader keeps views of it until its layer is
        whole) or, on one host, read in place from the shared file once the learner signals it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        device = "cuda" if self.cuda else "cpu"
        if self.shm_path:
            total = sum(_size(c) for c in chunks)
            if self.shm is None or self.shm.numel() < total:  # kept mapped: its pages are faulted in once
                self.shm = torch.from_file(self.shm_path, shared=True, size=total, dtype=torch.uint8)
            signal, off = torch.empty(1, dtype=torch.int64), 0
            for k, chunk in enumerate(chunks):
                self.group.broadcast([signal], opts).wait()
                if int(signal) != k:
                    raise RuntimeError(f"backstream engine: expected bucket {k}, the learner signalled {int(signal)}")
                yield self.shm[off:off + _size(chunk)], chunk
                off += _size(chunk)
            return

        def post(chunk):
            buf = torch.empty(_size(chunk), dtype=torch.uint8, device=device)
            return buf, self.group.broadcast([buf], opts)

        pending = post(chunks[0]) if chunks else None
        for k, chunk in enumerate(chunks):
            buf, work = pending
            work.wait()
            pending = post(chunks[k + 1]) if k + 1 < len(chunks) else None
            yield buf, chunk

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # noqa: PLC0415

        ledger, self.ledger = self.ledger, None
        LAST.clear()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            retie_head(self.model, self.model_config)
            if ledger is not None:
                LAST.update(ledger.record(), unloaded=unloaded(self.model, self.model_config, ledger.loaded))
        except Exception as e:  # noqa: BLE001  (recorded for the learner: see the module docstring)
            LAST.update(error=f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.shutdown()
        self.group = None
        JOINED.clear()


def _size(chunk) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in chunk)


def _views(buf, chunk):
    """The bucket's tensors as views of its bytes, in order."""
    off = 0
    for name, dtype, shape in chunk:
        n = math.prod(shape) * dtype.itemsize
        yield name, buf[off:off + n].view(dtype).view(shape)
        off += n


if WeightTransferEngineFactory is not None:
    with contextlib.suppress(ValueError):  # registered already (the module imported twice)
        WeightTransferEngineFactory.register_engine(BACKEND, BackstreamEngine)


class WorkerWeights:
    """The worker extension's methods that load weights (rl/backends/vllm/worker_ext.py's class has them)."""

    def backstream_reload(self, path: str, version: str = "") -> dict:
        """Load every weight of the safetensors files in `path` in place (the disk path), recorded as
        publish `version`; what it loaded (`backstream_ledger`)."""
        from vllm.model_executor.model_loader import get_model_loader  # noqa: PLC0415

        runner = self.model_runner
        model, config = runner.get_model(), runner.vllm_config.model_config
        STARTED_FROM.setdefault("model", config.model)
        STARTED_FROM.setdefault("revision", config.revision)
        config.model, config.model_weights, config.revision = path, "", None
        weights = get_model_loader(runner.vllm_config.load_config).get_all_weights(config, model)
        ledger = Ledger(version)
        LAST.clear()
        with _no_embedding_pack(model, config), recording(model, ledger):
            runner.reload_weights(weights_iterator=weights)
        retie_head(model, config)
        LAST.update(ledger.record(), unloaded=unloaded(model, config, ledger.loaded))
        return {"tensors": len(ledger.fingerprints)}

    def backstream_names(self) -> dict:
        """The tensors of the checkpoint this server started from: {"names": {name: shape}}, read from
        the safetensors headers; or {"error": ...}. What a policy of another class maps its names onto
        (rl/backends/vllm/weights/names.py)."""
        from safetensors import safe_open  # noqa: PLC0415

        try:
            names = {}
            for path in _checkpoint_files(self.model_runner):
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        names[key] = list(f.get_slice(key).get_shape())
            return {"names": names}
        except Exception as e:  # noqa: BLE001  (said to the run, which refuses the server with it)
            return {"error": f"{type(e).__name__}: {e}"}

    def backstream_keep(self, names: list[str]) -> dict:
        """The served tensors `names` (those no policy tensor maps to) loaded once more from this server's
        own checkpoint, through vLLM's reload: the parameters they fill (`KEPT`) are the ones every
        later publish leaves as served, and the ledger counts no other parameter as loaded unless the
        publish loaded it."""
        from safetensors import safe_open  # noqa: PLC0415

        runner = self.model_runner
        model, config, want = runner.get_model(), runner.vllm_config.model_config, set(names)
        files = _checkpoint_files(runner)

        def tensors():
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        if key in want:
                            yield key, f.get_tensor(key)

        ledger = Ledger("keep")
        with _no_embedding_pack(model, config), recording(model, ledger):
            runner.reload_weights(weights_iterator=tensors())
        retie_head(model, config)
        missing = sorted(want - set(ledger.fingerprints))
        if missing:
            raise ValueError(f"the checkpoint has no tensors {missing[:3]} ({len(missing)})")
        KEPT.clear()
        KEPT.update(ledger.loaded)
        return {"tensors": len(ledger.fingerprints), "parameters": len(KEPT)}

    def backstream_group(self) -> str:
        """The name of the transfer group this worker is in ("": none). A server of your own may have
        joined another learner's group since this one's (another run, or a test): that learner must
        join it again before it broadcasts, or the broadcast finds nobody at the other end."""
        return JOINED.get("prefix", "")

    def backstream_ledger(self) -> dict:
        """What the last publish loaded: its version, the fingerprint of every tensor handed to
        `load_weights`, the parameters it did not load (or the error that stopped it)."""
        return dict(LAST)


def _record_ipc() -> None:
    """vLLM's own CUDA IPC engine (vllm.colocate) records each publish into the ledger as this module's
    engine does: what its `load_weights` was handed and loaded."""
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine as Ipc  # noqa: PLC0415
    except ImportError:
        return
    if getattr(Ipc, "backstream_recorded", False):
        return
    start, receive, finish = Ipc.start_weight_update, Ipc.receive_weights, Ipc.finish_weight_update

    def start_weight_update(self):
        self.backstream_ledger = Ledger(None)  # (its update_info carries no version: the fingerprints tell)
        return start(self)

    def receive_weights(self, update_info):
        ledger = getattr(self, "backstream_ledger", None) or Ledger(None)
        with recording(self.model, ledger):
            return receive(self, update_info)

    def finish_weight_update(self):
        out = finish(self)
        ledger = getattr(self, "backstream_ledger", None)
        LAST.clear()
        if ledger is not None:
            LAST.update(ledger.record(), unloaded=unloaded(self.model, self.model_config, ledger.loaded))
        return out

    Ipc.start_weight_update, Ipc.receive_weights = start_weight_update, receive_weights
    Ipc.finish_weight_update, Ipc.backstream_recorded = finish_weight_update, True


if WeightTransferEngineFactory is not None:
    _record_ipc()
