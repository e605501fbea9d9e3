"""`backstream export`: the int4 packing against compressed-tensors' own; the folder of each format
holds exactly the learner's codes and scales and reloads through transformers to the learner's
quantized forward (float64: w4a16 as it runs there; w8a8/fp8 once vLLM's activation quantizer
replaces compressed-tensors' fake-quant, whose w8a8 differs: absmax/127.5); a LoRA run (quantized
base + its adapter); a run the trainer wrote; bad input refused before anything is written, and no
half-written folder when a write fails."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from backstream import checkpoint
from backstream.cli import main
from backstream.default_model import build_tokenizer
from backstream.export import export
from backstream.quant.formats import pack_int4, unpack_int4
from backstream.quant.linear import (
    QuantConfig,
    dequantize_weight,
    quant_linears,
    quantize_fp8_act,
    quantize_int8_act,
    quantize_model,
    quantized,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
FORMATS = ["w8a8", "w4a16", "fp8"]
CT_FORMAT = {"w8a8": "int-quantized", "w4a16": "pack-quantized", "fp8": "float-quantized"}
TOKENS = torch.tensor([[5, 17, 30, 9, 44, 61, 3, 28, 70, 12, 8], [40, 2, 33, 33, 90, 7, 15, 60, 21, 4, 11]])


def tiny(dtype=torch.float64, seed=0):
    """2 layers, widths 64 and 128 (groups of 32 and 64 divide them), q/k/v/o biases, tied embeddings."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attention_bias=True, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
    return model, tok


def tiny_moe():
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen3MoeForCausalLM(cfg).eval(), tok


def make_run(path, model, tok, toml: str, step: int = 3) -> str:
    """A run folder as the trainer leaves it: config.toml and one checkpoint."""
    os.makedirs(path)
    with open(os.path.join(path, "config.toml"), "w") as f:
        f.write(toml)
    checkpoint.save(str(path), step, model, tok, {"step": step})
    return str(path)


def full_run(tmp_path, fmt=None, name="run"):
    """A full fine-tune in float64 that sampled with `fmt` (aligned learner), or without quantization."""
    model, tok = tiny()
    quant = f'rollout = "{fmt}"\naligned = true\n' if fmt else ""
    toml = f'[model]\ndtype = "float64"\n[quant]\n{quant}group_size = 32\n'
    return make_run(tmp_path / name, model, tok, toml), model


def learner_logits(model, fmt):
    learner = copy.deepcopy(model)
    quantize_model(learner, QuantConfig(rollout=fmt, group_size=32))
    with torch.no_grad(), quantized(learner, True):
        return learner, learner(TOKENS).logits


def vllm_activations(model, fmt):
    """Replace compressed-tensors' activation fake-quant in a loaded model by vLLM's (backstream.quant.linear)."""
    quantize = quantize_int8_act if fmt == "w8a8" else quantize_fp8_act

    def hook(module, args):
        codes, scale = quantize(args[0])
        return ((codes.to(scale.dtype) * scale).to(args[0].dtype),)

    for mod in model.modules():
        if getattr(mod, "quantization_scheme", None) is not None:
            mod.quantization_enabled = False  # the weights are already dense: this only drops their QDQ
            mod.register_forward_pre_hook(hook)


# ---- packing ------------------------------------------------------------------------------------

def test_pack_int4_round_trips_and_refuses_what_vllm_could_not_load():
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 8), (3, 64), (7, 256)):
        codes = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
        codes[0, :2] = torch.tensor([-8, 7])  # both ends of the range
        words = pack_int4(codes)
        assert words.dtype == torch.int32 and words.shape == (shape[0], shape[1] // 8)
        assert torch.equal(unpack_int4(words), codes)
    # by hand: codes 0..7 of a row, offset +8 → nibbles 8..15, the first in the lowest bits
    word = pack_int4(torch.arange(8, dtype=torch.int8)[None])
    assert int(word) == 0xFEDCBA98 - 2**32
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((2, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_int4(torch.zeros(2, 8, dtype=torch.int32))


def test_pack_int4_is_compressed_tensors_layout():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

    codes = torch.randint(-8, 8, (5, 128), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    codes[:, 0], codes[:, -1] = -8, 7
    assert torch.equal(pack_int4(codes), pack_to_int32(codes, 4))
    assert torch.equal(unpack_from_int32(pack_int4(codes), 4, codes.shape), codes)


# ---- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_export_holds_the_learners_tensors_and_reloads_to_its_forward(tmp_path, fmt):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    run, model = full_run(tmp_path, fmt)
    out = export(run, fmt)
    assert out == os.path.join(run, f"export-{fmt}-step-3")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "backstream_export.json"} <= set(os.listdir(out))
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", CT_FORMAT[fmt], ["lm_head"])
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]  # compressed-tensors reads it

    # (1) the file holds the learner's codes and scales, bit for bit; compressed-tensors' own
    # decompression gives the learner's dequantized weights, bit for bit
    learner, ours = learner_logits(model, fmt)
    qlins = quant_linears(learner)
    assert len(qlins) == 14  # 7 linears per decoder layer; lm_head and embeddings stay as they were
    saved = load_file(os.path.join(out, "model.safetensors"))
    compressor = BaseCompressor.get_value_from_registry(CT_FORMAT[fmt])
    for name, mod in qlins.items():
        q = mod.qweight()
        assert torch.equal(saved[f"{name}.weight_scale"], q.scale)
        if mod.bias is not None:  # q/k/v/o
            assert torch.equal(saved[f"{name}.bias"], mod.bias.detach())
        if fmt == "w4a16":
            from compressed_tensors.compressors.pack_quantized import unpack_from_int32

            assert saved[f"{name}.weight_shape"].tolist() == list(q.codes.shape)
            assert torch.equal(unpack_from_int32(saved[f"{name}.weight_packed"], 4, q.codes.shape), q.codes)
            mine = {k: saved[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        else:
            assert saved[f"{name}.weight"].dtype == q.codes.dtype
            assert torch.equal(saved[f"{name}.weight"].view(torch.uint8), q.codes.view(torch.uint8))
            mine = {k: saved[f"{name}.{k}"] for k in ("weight", "weight_scale")}
        dense = compressor.decompress(mine, scheme)["weight"]
        assert torch.equal(dense, dequantize_weight(q, torch.float32))
    assert saved["model.embed_tokens.weight"].dtype == torch.float64 and "lm_head.weight" not in saved  # tied

    # (2) transformers + compressed-tensors: dense weights = codes · scale; w4a16 (weight-only) runs
    # the learner's forward; w8a8/fp8 do once their activation fake-quant is vLLM's
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    with torch.no_grad():
        theirs = hf(TOKENS).logits  # also decompresses the weights
    for name, mod in qlins.items():
        assert torch.equal(hf.get_submodule(name).weight, dequantize_weight(mod.qweight(), torch.float64))
    scale = float(ours.abs().max())
    gap = float((theirs - ours).abs().max())
    print(f"\n{fmt}: transformers' own runtime vs the learner, max |Δlogit| = {gap:.3g} (logits up to {scale:.3g})")
    assert gap < 0.05 * scale  # the folder runs; w8a8's gap is compressed-tensors' absmax/127.5
    if fmt == "w4a16":
        assert gap <= 1e-12
    else:
        vllm_activations(hf, fmt)
        with torch.no_grad():
            aligned = hf(TOKENS).logits
        assert float((aligned - ours).abs().max()) <= 1e-12 * scale


def test_lora_run_exports_the_quantized_base_and_its_adapter(tmp_path):
    pytest.importorskip("compressed_tensors")
    from peft import PeftModel, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from backstream.config import load

    base, tok = tiny()
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    toml = (f'[model]\nname = "{tmp_path / "base"}"\ndtype = "float64"\nlora_r = 4\n'
            '[quant]\nrollout = "w4a16"\naligned = true\ngroup_size = 32\n')
    cfg = load(None, [f'model.name="{tmp_path / "base"}"', 'model.dtype="float64"', "model.lora_r=4",
                      'quant.rollout="w4a16"', "quant.aligned=true", "quant.group_size=32"])
    learner, _ = cfg.model.build()  # as the trainer: LoRA, then the base layers quantized
    quantize_model(learner, cfg.quant)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=g)  # a trained adapter
    run = make_run(tmp_path / "run", learner, tok, toml)
    with torch.no_grad(), quantized(learner, True):
        ours = learner(TOKENS).logits

    out = export(run, "w4a16")
    ckpt = checkpoint.latest(run)
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # the learner's adapter, unchanged
        assert open(os.path.join(out, "adapter", name), "rb").read() == open(os.path.join(ckpt, name), "rb").read()
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in saved and not any("lora" in k for k in saved)

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    with torch.no_grad():
        hf(TOKENS[:, :2])  # compressed-tensors decompresses on the first forward; PEFT wraps dense linears
        served = PeftModel.from_pretrained(hf, os.path.join(out, "adapter"))(TOKENS).logits
    assert float((served - ours).abs().max()) <= 1e-12
    with torch.no_grad():  # and the adapter matters: the base alone is another model
        learner_base = copy.deepcopy(learner)
        set_peft_model_state_dict(learner_base, {k: torch.zeros_like(v) for k, v in
                                                 load_file(os.path.join(ckpt, "adapter_model.safetensors")).items()})
        with quantized(learner_base, True):
            assert float((learner_base(TOKENS).logits - ours).abs().max()) > 1e-3


def test_a_run_the_trainer_wrote_exports_its_learner(tmp_path):
    pytest.importorskip("compressed_tensors")
    from helpers import run_cfg
    from transformers import AutoModelForCausalLM

    from backstream import trainer

    model, tok = tiny()
    t = trainer.Trainer(run_cfg(tmp_path, "run", 'quant.rollout="w8a8"', "quant.aligned=true", "train.steps=1",
                                "engine.verify=false", "rollout.max_new_tokens=4"),
                        model=model, tokenizer=tok)
    try:
        t.train_step()
        t.save()
    finally:
        t.run_folder.release()
        t.logger.close()
    with torch.no_grad(), quantized(t.model, True):
        ours = t.model(TOKENS).logits
    out = export(t.run_dir, "w8a8", out=str(tmp_path / "served"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    vllm_activations(hf, "w8a8")
    with torch.no_grad():
        assert float((hf(TOKENS).logits - ours).abs().max()) <= 1e-12


def test_targets_and_ignore_are_the_modules_the_learner_quantized(tmp_path):
    model, tok = tiny()
    toml = '[model]\ndtype = "float64"\n[quant]\ntargets = ["*.o_proj", "*.down_proj"]\n'
    run = make_run(tmp_path / "run", model, tok, toml)
    out = export(run, "w8a8")
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]
    assert sorted(qc["ignore"]) == sorted(layers + ["lm_head"])
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(k for k in saved if k.endswith("weight_scale")) == sorted(
        f"model.layers.{i}.{m}.weight_scale" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj"))
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float64

    # vLLM runs q/k/v (and gate/up) as one fused layer: all of its parts quantized, or none
    split = make_run(tmp_path / "split", model, tok, '[quant]\ntargets = ["*.q_proj"]\n')
    with pytest.raises(ValueError, match="vLLM fuses"):
        export(split, "w8a8")
    assert not [n for n in _entries(split) if n.startswith("export")]


# ---- refusals -------------------------------------------------------------------------------------

def _entries(path):
    return sorted(os.listdir(path))


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    run, _ = full_run(tmp_path, "w4a16")
    before = _entries(run)
    cases = [
        (dict(run_dir=str(tmp_path), quant="w8a8"), "not a run folder"),
        (dict(run_dir=run, quant="int3"), "--quant"),
        (dict(run_dir=run, quant="w4a16", group_size=48), "--group-size"),
        (dict(run_dir=run, quant="w8a8", group_size=32), "w4a16 only"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            export(**kwargs)
    with pytest.warns(UserWarning, match="group 32"), pytest.raises(ValueError, match="does not divide"):
        export(run, "w4a16", group_size=128)  # hidden 64: groups of 128 do not fit
    assert _entries(run) == before

    empty = tmp_path / "empty"
    os.makedirs(empty / "checkpoints")
    (empty / "config.toml").write_text("")
    with pytest.raises(ValueError, match="no intact checkpoint"):
        export(str(empty), "w8a8")
    damaged, _ = full_run(tmp_path, name="damaged")
    with open(os.path.join(checkpoint.latest(damaged), "model.safetensors"), "r+b") as f:
        f.truncate(100)
    with pytest.warns(UserWarning, match="damaged"), pytest.raises(ValueError, match="no intact checkpoint"):
        export(damaged, "w8a8")

    moe, tok = tiny_moe()  # experts as fused 3-D weights, left dense by the learner: transformers cannot load that
    moe_run = make_run(tmp_path / "moe", moe, tok, "")
    with pytest.raises(ValueError, match="MoE"):
        export(moe_run, "w8a8")
    assert not [n for n in _entries(moe_run) if n.startswith("export")]

    taken = tmp_path / "taken"
    os.makedirs(taken)
    (taken / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        export(run, "w8a8", out=str(taken))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export(run, "w8a8", out=str(tmp_path / "a-file"))
    assert _entries(taken) == ["mine.txt"] and _entries(run) == before


def test_overwrite_moves_the_old_folder_aside_and_an_empty_one_is_used(tmp_path):
    run, _ = full_run(tmp_path)
    out = tmp_path / "out"
    os.makedirs(out)
    assert export(run, "fp8", out=str(out)) == str(out) and "config.json" in _entries(out)
    export(run, "w4a16", out=str(out), overwrite=True)
    assert json.load(open(out / "backstream_export.json"))["format"] == "w4a16"
    aside = [n for n in _entries(tmp_path) if n.startswith("out.old-")]
    assert len(aside) == 1 and json.load(open(tmp_path / aside[0] / "backstream_export.json"))["format"] == "fp8"


def test_a_failed_write_leaves_no_folder(tmp_path, monkeypatch):
    run, _ = full_run(tmp_path)

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)  # after the weights are written
    with pytest.raises(OSError, match="No space"):
        export(run, "w8a8", out=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    assert not [n for n in _entries(tmp_path) if "tmp-export" in n]


def test_cli(tmp_path, capsys):
    run, _ = full_run(tmp_path)
    out = tmp_path / "served"
    assert main(["export", run, "--quant", "w4a16", "--group-size", "64", "--out", str(out)]) == 0
    assert f"exported: {out}" in capsys.readouterr().out
    assert load_file(out / "model.safetensors")["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 2)
    assert main(["export", run, "--quant", "w3a3"]) == 2
    assert "--quant" in capsys.readouterr().err
