"""`backstream verify`: the miniature keeps the architecture, the verdicts (exact, refused, wrong,
error, could not build) are what the engine does, the CLI's exit codes, the trainer's engine.verify."""

import json
import os
import sys
import warnings

import pytest
import torch
from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

from backstream import cli, config, trainer
from backstream.default_model import build_tokenizer
from backstream.rl.update import backward
from backstream.stream import engine, family
from backstream.stream.miniature import keep_float64, miniature, miniature_config
from backstream.stream.verify import TOL, Verdict, VerifyReport, role, verify

warnings.filterwarnings("ignore", category=FutureWarning)
verify_mod = sys.modules["backstream.stream.verify"]  # `backstream.stream.verify` is the function


def layer_types(cfg):
    return getattr(cfg.get_text_config(), "layer_types", None)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_oss", "llama4_text", "deepseek_v3", "qwen3_moe"])
def test_miniature_keeps_the_architecture(model_type):
    full = AutoConfig.for_model(model_type)
    model = miniature(model_type)
    cfg = model.config
    assert cfg.model_type == model_type and not model.training
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert cfg.hidden_size == 32 and cfg.vocab_size == 61 and cfg.num_attention_heads == 4
    assert all(0 <= getattr(cfg, k) < 61 for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if isinstance(getattr(cfg, k, None), int))
    if layer_types(full):  # one layer of every type, in the original order, nothing else
        assert set(cfg.layer_types) == set(full.layer_types) and cfg.num_hidden_layers == len(cfg.layer_types) == 2
    else:
        assert cfg.num_hidden_layers == 2
    for key in ("sliding_window", "attention_chunk_size"):
        if getattr(full, key, None):
            assert getattr(cfg, key) == 4  # the test sequences (up to 18 tokens) cross it
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(full, key, None):
            assert 0 < getattr(cfg, key) <= 2
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if (getattr(full, key, 0) or 0) > 1:
            assert getattr(cfg, key) == 4 and cfg.num_experts_per_tok <= 2
            assert cfg._experts_implementation == "eager"
    if model_type == "deepseek_v3":  # MLA dimensions
        dims = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim)
        assert dims == (16, 16, 4, 8, 8)
        assert cfg.first_k_dense_replace == 1  # layer 0 dense, layer 1 MoE
    if model_type == "llama4_text":  # NoPE on the full layer, RoPE on the chunked one, as in the original
        assert cfg.no_rope_layers == [full.no_rope_layers[full.layer_types.index(t)] for t in cfg.layer_types]
    # norms are random (0.5..1.5), not HF's constant 1
    norms = [p for n, p in model.named_parameters() if "norm" in n and p.dim() == 1]
    assert norms and all(float(p.detach().std()) > 0 for p in norms)


def test_miniature_resizes_rope_and_keeps_every_layer_type():
    """longrope's per-frequency factors follow the new head_dim, its pretraining length is crossed;
    three layer types give three layers; a config object, a folder and "default" all work."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 64 for i in range(64)],
            "long_factor": [2.0 + i / 64 for i in range(64)], "original_max_position_embeddings": 4096}
    cfg = AutoConfig.for_model("phi3", hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                               rope_parameters=rope)
    mini = miniature_config(cfg)
    rp = mini.rope_parameters
    assert len(rp["short_factor"]) == len(rp["long_factor"]) == 4  # head_dim 8: 4 frequencies
    assert rp["short_factor"][0] == 1.0 and rp["long_factor"][-1] == rope["long_factor"][-1]
    assert rp["original_max_position_embeddings"] <= 8 < mini.max_position_embeddings
    q = Qwen3Config(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                    sliding_window=4096, use_sliding_window=True)
    assert miniature_config(q).layer_types == ["sliding_attention", "full_attention"]
    mixed = AutoConfig.for_model("gemma3_text", num_hidden_layers=7,
                                 layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3)
    assert miniature_config(mixed).layer_types == ["sliding_attention", "full_attention"]
    assert miniature("default").config.model_type == "qwen3"


def test_miniature_from_a_folder(tmp_path):
    Qwen3Config(hidden_size=1024, num_hidden_layers=28).save_pretrained(tmp_path)
    model = miniature(str(tmp_path))
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_exact_on_llama_and_qwen3(name):
    rep = verify(name)
    assert rep.ok and rep.verdict == "exact" and rep.kind == "exact"
    assert rep.worst <= TOL and rep.errors["attn.q"] and rep.errors["mlp"]
    assert all(x is not None and x <= TOL for row in rep.errors.values() for x in row)
    assert len(rep.logprob_error) == len(rep.block_sizes) == 3
    text = str(rep)
    assert "verdict: exact" in text and "attn.k" in text and "block 3" in text
    json.dumps(rep.to_dict())


def _qwen3(**kw):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw))


def test_lora_model_is_verified_with_its_lora_config():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_qwen3(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rep = verify(model)
    assert rep.ok and rep.features["lora"] == "r=4"
    assert rep.tensors["attn.q"] == 4  # lora_A and lora_B of 2 layers: the only trainable tensors
    assert "mlp" not in rep.tensors
    assert all(p.grad is None for p in model.parameters())  # the user's model is not touched


def test_attention_dropout_in_train_mode_is_refused_not_wrong():
    model = _qwen3(attention_dropout=0.1).train()
    rep = verify(model)
    assert rep.kind == "refused" and not rep.ok, rep.verdict
    assert "dropout" in rep.verdict
    assert verify(model.eval()).ok  # in eval mode dropout does nothing


def test_a_wrong_engine_is_caught(monkeypatch):
    """An engine whose gradient is off by 1e-6 (relative) is caught as wrong; an exception of
    stream_backward's own (outside the model) is an error, not a refusal."""
    real = engine.stream_backward

    def off(model, *a, **k):
        res = real(model, *a, **k)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1 + 1e-6)
        return res

    monkeypatch.setattr(engine, "stream_backward", off)
    rep = verify("llama")
    assert rep.kind == "wrong" and not rep.ok and 1e-7 < rep.worst < 1e-5
    assert "relative error" in rep.reason and "verdict: wrong" in str(rep)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "stream_backward", boom)
    rep = verify("llama")
    assert rep.verdict == "error: RuntimeError: boom"


def test_a_refusal_is_known_by_its_type(monkeypatch):
    """A ModelContractError is a refusal whatever its message says; any other exception, even one
    whose message starts with `model:`, is an error of stream_backward."""

    def raising(e):
        def fn(*a, **k):
            raise e
        return fn

    monkeypatch.setattr(engine, "stream_backward", raising(family.Unsupported("reworded, no prefix")))
    rep = verify("llama")
    assert rep.kind == Verdict.REFUSED and rep.verdict == "refused: reworded, no prefix"
    monkeypatch.setattr(engine, "stream_backward", raising(ValueError("model: looks like a refusal")))
    assert verify("llama").verdict == "error: ValueError: model: looks like a refusal"


def test_could_not_build(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    rep = verify(str(tmp_path))
    assert rep.kind == "could not build" and not rep.ok


def test_keep_float64_removes_the_float32_noise():
    x = torch.randn(5, dtype=torch.float64)
    with keep_float64():
        softmax_dtype = torch.softmax(x, 0, dtype=torch.float32).dtype
        assert x.float().dtype == x.to(torch.float32).dtype == softmax_dtype == torch.float64
    assert x.float().dtype == torch.float32


def test_roles():
    assert role("model.layers.0.self_attn.q_proj.weight") == "attn.q"
    assert role("base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight") == "attn.v"
    assert role("model.layers.1.mlp.gate.weight") == "router/experts"
    assert role("model.layers.1.mlp.gate_proj.weight") == "mlp"
    assert role("model.layers.0.input_layernorm.weight") == "norm"
    assert role("transformer.h.0.attn.c_proj.weight") == "attn.o" and role("transformer.h.0.mlp.c_proj.weight") == "mlp"
    assert role("model.embed_tokens.weight") == "embed" and role("lm_head.weight") == "lm_head"


# -- the command line --------------------------------------------------------------------------


CLI_CASES = [  # (kind, reason) of the report, the verdict printed, the exit code
    (Verdict.EXACT, "", "exact", 0),
    (Verdict.REFUSED, "model: no", "refused: model: no", 1),
    (Verdict.COULD_NOT_BUILD, "x", "could not build: x", 2),
    (Verdict.WRONG, "", "wrong", 3),
    (Verdict.ERROR, "RuntimeError: x", "error: RuntimeError: x", 3),
]


@pytest.mark.parametrize("kind, reason, verdict, code", CLI_CASES)
def test_cli_exit_codes(monkeypatch, capsys, kind, reason, verdict, code):
    monkeypatch.setattr(verify_mod, "verify", lambda name, seed=0: VerifyReport(model_type=name, kind=kind,
                                                                                reason=reason))
    assert cli.main(["verify", "llama"]) == code
    assert f"verdict: {verdict}" in capsys.readouterr().out
    assert {c[0] for c in CLI_CASES} == set(Verdict)  # every verdict has its exit code checked


def test_cli_runs_verify(capsys, tmp_path):
    assert cli.main(["verify", "llama"]) == 0
    out = capsys.readouterr().out
    assert "verdict: exact" in out and "attn.q" in out
    assert cli.main(["verify", str(tmp_path)]) == 2  # no config.json there
    assert "could not build" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "absent")]) == 2  # a path, not taken for a Hub id
    assert "is no folder here; pass a folder holding config.json" in capsys.readouterr().out


# -- the trainer ---------------------------------------------------------------------------------


def _run(tmp_path, *extra):
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    cfg = config.load(None, ["train.steps=1", "train.prompts_per_step=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=3", "data.num_examples=8", "train.progress=false",
                             f'train.output_dir="{tmp_path / "run"}"', *extra])
    return trainer.train(cfg, model=model, tokenizer=tok)


def test_trainer_verifies_unless_told_not_to(tmp_path, monkeypatch):
    calls = []

    def fake(model, **kw):
        calls.append(model)
        return VerifyReport(model_type="qwen3", kind=Verdict.EXACT)

    monkeypatch.setattr(verify_mod, "verify", fake)
    monkeypatch.setattr(backward, "_VERIFIED", {})
    _run(tmp_path / "a", "engine.verify=false")
    assert calls == []
    _run(tmp_path / "b")
    assert len(calls) == 1
    backward.verify_engine(calls[0])  # the same architecture again in this process: checked once
    assert len(calls) == 1


def test_trainer_stops_before_writing_when_not_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_mod, "verify", lambda model, **kw: VerifyReport(
        model_type="qwen3", kind=Verdict.REFUSED, reason="model: chunked attention"))
    monkeypatch.setattr(backward, "_VERIFIED", {})
    with pytest.raises(ValueError, match=r"engine.verify: .*refused: model: chunked attention.*engine.verify = false"):
        _run(tmp_path)
    assert not os.path.exists(tmp_path / "run")
