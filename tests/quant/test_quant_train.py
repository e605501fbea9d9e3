"""QaRL in the RL loop: the [quant] section, quantized rollouts, the aligned learner (mismatch 0)
and the unaligned one (mismatch > 0, reported), TBPO and the IS corrections through the trainer,
and the bad combinations refused before anything runs."""

import math
import os
import warnings

import pytest
import torch
from helpers import rel, run_cfg, tiny, weights

from backstream import config, trainer
from backstream.metrics import read
from backstream.quant.linear import QuantLinear, quant_linears
from backstream.rl.update.backward import StreamedBackward

warnings.filterwarnings("ignore", category=FutureWarning)


def test_quant_section_loads_and_documents_itself():
    cfg = config.load(None, ['quant.rollout="w4a16"', "quant.group_size=32", "quant.aligned=true",
                             'loss.type="tbpo"', "loss.seq_tis_imp_ratio_cap=3"])
    assert (cfg.quant.rollout, cfg.quant.group_size, cfg.quant.aligned) == ("w4a16", 32, True)
    assert type(cfg.loss).__name__ == "TBPOConfig" and cfg.loss.seq_tis_imp_ratio_cap == 3.0
    text = config.describe()
    assert "[quant]" in text and "aligned" in text and '(type = "tbpo")' in text
    assert "[quant]" in config.to_toml(cfg.to_dict())


@pytest.mark.parametrize("overrides, match", [
    (['quant.rollout="w3a3"'], "quant.rollout"),
    (["quant.aligned=true"], "quant.aligned"),  # aligned to what? rollout = "none"
    (['quant.rollout="w4a16"', "quant.group_size=48"], "quant.group_size"),
    (['quant.rollout="w8a8"', "engine.reuse_rollout_kv=true"], "reuse_rollout_kv"),  # K/V of another forward
    (['loss.type="tbpo"', 'loss.is_level="token"'], "is_level"),
    (['loss.is_level="sequence"', "loss.is_cap_high=0.5", "loss.is_cap_low=1"], "is_cap"),
])
def test_bad_quant_config_is_refused_before_anything_runs(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        cfg = config.load(None, [f'train.output_dir="{tmp_path / "run"}"', *overrides])
        cfg.validate()
    assert not os.path.exists(tmp_path / "run")


def test_group_size_that_does_not_divide_is_refused_before_the_run_folder(tmp_path):
    model, tok = tiny(torch.float32)  # hidden 32: a group of 64 does not divide in_features
    with pytest.raises(ValueError, match="group"):
        trainer.train(run_cfg(tmp_path, "run", 'quant.rollout="w4a16"', "quant.group_size=64"),
                      model=model, tokenizer=tok)
    assert not os.path.exists(tmp_path / "run" / "config.toml")


def _run(tmp_path, name, *extra, dtype="float64"):
    model, tok = tiny(torch.float64 if dtype == "float64" else torch.float32)
    # count_digits: a dense reward, so that every step has advantages (the learner computes log-probs
    # only where the loss reads them, and the mismatch is measured there)
    t = trainer.Trainer(run_cfg(tmp_path, name, f'model.dtype="{dtype}"', "quant.group_size=32",
                                "reward.functions=['rewards_for_tests:count_digits']", "rollout.max_new_tokens=10",
                                *extra), model=model, tokenizer=tok)
    try:
        rows = [t.train_step() for _ in range(2)]
    finally:
        t.run_folder.release()
        t.logger.close()
    return t, rows


@pytest.mark.parametrize("fmt", ["w8a8", "w4a16", "fp8"])
def test_aligned_learner_has_no_mismatch_and_unaligned_has_some(tmp_path, fmt):
    t, aligned = _run(tmp_path, f"a-{fmt}", f'quant.rollout="{fmt}"', "quant.aligned=true")
    assert quant_linears(t.model) and all(isinstance(m, QuantLinear) for m in quant_linears(t.model).values())
    _, unaligned = _run(tmp_path, f"u-{fmt}", f'quant.rollout="{fmt}"')
    for rows, name in ((aligned, "aligned"), (unaligned, "unaligned")):
        for key in ("mismatch/kl", "mismatch/abs_log_ratio/mean", "mismatch/ratio/max", "mismatch/error_token_share"):
            assert key in rows[0] and math.isfinite(rows[0][key]), (name, key)
    # float64: the learner's quantized forward is the sampler's up to float64 rounding
    assert max(r["mismatch/abs_log_ratio/mean"] for r in aligned) < 1e-9
    assert min(r["mismatch/abs_log_ratio/mean"] for r in unaligned) > 1e-6


@pytest.mark.parametrize("loss", ["ppo_clip", "tbpo"])
def test_aligned_learner_takes_the_samplers_kv_exactly(tmp_path, monkeypatch, loss):
    """Aligned learner + engine.reuse_rollout_kv: no prefill at all, and the same update as with a
    prefill of its own (float64), TBPO's sequence ratios included."""
    prefilled = []
    backward = StreamedBackward.backward

    def spy(self, *args, **kwargs):
        res = backward(self, *args, **kwargs)
        prefilled.append(res.stats.prefill_tokens)
        return res

    monkeypatch.setattr(StreamedBackward, "backward", spy)
    runs = {}
    for reuse in ("true", "false"):
        prefilled.clear()
        t, rows = _run(tmp_path, f"kv-{reuse}", 'quant.rollout="w8a8"', "quant.aligned=true",
                       f"engine.reuse_rollout_kv={reuse}", f'loss.type="{loss}"')
        runs[reuse] = (weights(t.model), rows, list(prefilled))
    assert rel(runs["true"][0], runs["false"][0]) < 1e-10
    assert runs["true"][2] == [0, 0] and all(n > 0 for n in runs["false"][2])
    assert max(r["mismatch/abs_log_ratio/mean"] for r in runs["true"][1]) < 1e-9


def test_tbpo_and_is_corrections_train_under_quantized_rollouts(tmp_path):
    _, tbpo = _run(tmp_path, "tbpo", 'quant.rollout="w8a8"', 'loss.type="tbpo"', "update.minibatches=2")
    for key in ("tbpo/masked_frac", "tbpo/weight_mean"):
        assert key in tbpo[0], key
    # an unaligned learner: the mismatch weight moves off 1
    assert any(abs(r["tbpo/weight_mean"] - 1) > 1e-8 for r in tbpo)
    _, tis = _run(tmp_path, "tis", 'quant.rollout="w4a16"', 'loss.is_level="token"', 'loss.is_mode="truncate"')
    assert "is/weight_mean" in tis[0] and abs(tis[0]["is/weight_mean"] - 1) > 1e-8


def test_quantized_run_checkpoints_master_weights_and_resumes(tmp_path):
    """The checkpoint holds the full-precision master weights under the usual names (the quantized
    linear keeps nn.Linear's parameter names), and a resumed run quantizes again."""
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', 'quant.rollout="w8a8"', "quant.aligned=true",
                  "train.steps=2")
    run_dir = trainer.train(cfg, model=model, tokenizer=tok)
    assert len(read(run_dir)) == 2
    from safetensors.torch import load_file

    from backstream import checkpoint
    saved = load_file(os.path.join(checkpoint.latest(run_dir), "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert "model.layers.0.self_attn.q_proj.weight" in saved


def test_codes_follow_the_master_weights_after_each_optimizer_step(tmp_path):
    from backstream.quant.linear import quantize_weight

    t, _ = _run(tmp_path, "codes", 'quant.rollout="w8a8"', "quant.aligned=true")
    for name, m in quant_linears(t.model).items():
        q, ref = m.qweight(), quantize_weight(m.weight, "w8a8")
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale, ref.scale), name
