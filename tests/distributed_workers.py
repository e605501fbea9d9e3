"""What tests/distributed/test_distributed.py runs on each rank of a torchrun-like job (tests/dist.py spawns the
processes with torchrun's environment and `init=False`, so the trainer starts the process group
itself) and, for the single-process reference, in the test process with a process group of one.

The model is a tiny float64 Qwen3 with exact norms, the same on every rank (seeded); the runs are
`trainer.train` with the config of `run_cfg`, as a user's would be.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
from dist import ALL_GATHER, REDUCE_SCATTER
from fake_backend import FakeBackend
from helpers import tiny, tiny_moe

from backstream import config, trainer
from backstream.rl.parallel import collectives
from backstream.stream import fsdp

warnings.filterwarnings("ignore", category=FutureWarning)
STEPS = 2

# name → overrides: the runs compared with the single-process reference; between them every loss
# normaliser that must be global (Σ|y_i| of token-mean, N of GSPO/TBPO, L_max of Dr.GRPO), DAPO refills
# (rank 1 samples nothing in a refill of one group), the rollout's K/V reused, the KL reference
CASES = {
    "stream": ['engine.backward="stream"', "train.save_every=1"],
    "reference": ['engine.backward="reference"', 'loss.type="gspo"'],
    # KL to the base model under the adapters
    "lora": ['engine.backward="stream"', "model.lora_r=4", "model.lora_alpha=8", "engine.reuse_rollout_kv=true",
             "update.kl_reference=true", "loss.kl_coef=0.1"],
    # full fine-tuning with a KL term: the frozen reference (a copy of the model passed in) is sharded too
    "kl_full": ['engine.backward="stream"', "update.kl_reference=true", "loss.kl_coef=0.5"],
    "epochs_minibatches": ['engine.backward="stream"', "update.epochs=2", "update.minibatches=2",
                           "train.prompts_per_step=4", 'loss.aggregation="seq-mean-token-sum-norm"'],
    # QaRL: the quantized layers hold the master weights FSDP shards; codes from the gathered weights
    "quant": ['engine.backward="stream"', 'quant.rollout="w8a8"', "quant.aligned=true"],
    # float32 (the model is cast by model.dtype): the same update up to float32 rounding
    "float32": ['engine.backward="stream"', 'model.dtype="float32"'],
    # FSDP2 mixed precision: bf16 gathers and compute, float32 master weights and reductions
    "bf16": ['engine.backward="stream"', 'model.dtype="float32"', 'distributed.mixed_precision="bf16"'],
    # the MoE load-balancing loss: routing counts of the whole minibatch, summed over the ranks
    "moe_router": ['engine.backward="stream"', "loss.router_aux_coef=0.05"],
    "dapo_tbpo": ['engine.backward="stream"', "rollout.dynamic_sampling=true", "rollout.max_refills=3",
                  'loss.type="tbpo"', "reward.functions=['distributed_workers:flat_for_half']"],
    # DAPO refills with the rollout's K/V: each rank trains the kept groups it sampled (K/V do not travel)
    "dapo_kv": ['engine.backward="stream"', "rollout.dynamic_sampling=true", "rollout.max_refills=3",
                "engine.reuse_rollout_kv=true", "train.prompts_per_step=4",
                "reward.functions=['distributed_workers:flat_for_half']"],
    # multi-turn episodes against an environment (a text game: step(text) answers twice), their K/V reused:
    # each rank plays its groups' episodes with fresh instances, the rewards come back with the rollouts
    "episodes": ['engine.backward="stream"', 'env.factory="envs_for_tests:Game"', "engine.reuse_rollout_kv=true",
                 "rollout.max_new_tokens=8", 'rollout.stop=["a", "e", "i", "o", "u", "1", "2", "3", "4", "5"]',
                 "reward.functions=['rewards_for_tests:ones_in_turns']"],
    # an agent program through each rank's own endpoint: its rewritten history as forks of its samples,
    # every rank's forks in the global batch, the agent's return value the reward
    "agent": ['engine.backward="stream"', 'env.agent="agents_for_tests:rewriting_agent"', 'env.format="plain"',
              "reward.functions=['env']", "env.max_turns=4"],
    # asynchronous training: each rank's rollout source samples its positions of the stream a step ahead
    # through a backend of the protocol (tests/fake_backend.py: no model, tokens from each group's seed),
    # every token labelled with the weights synced when it was drawn
    "async": ['engine.backward="stream"', "rollout.max_staleness=1"],
}


def run_cfg(out: str, *extra):
    return config.load(None, [
        'model.dtype="float64"', f"train.steps={STEPS}", "train.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=5", "data.num_examples=32", "optim.lr=1e-2", "train.progress=false",
        "train.plots=false", "engine.block_size=3", "distributed.timeout_s=60",
        "reward.functions=['rewards_for_tests:count_digits']", f'train.output_dir="{out}"', *extra])


def full_weights(model) -> dict[str, torch.Tensor]:
    """The whole weights (DTensor shards gathered: a collective), float64, on the CPU."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().to("cpu", torch.float64).clone()
    return out


class Counter:
    """Counts FSDP's gradient reductions (reduce-scatters) and parameter all-gathers of this rank."""

    def __init__(self):
        self.n = {"reduce_scatter": 0, "all_gather": 0}
        self.real = (getattr(dist, REDUCE_SCATTER), getattr(dist, ALL_GATHER))

    def __enter__(self):
        rs, ag = self.real

        def reduce_scatter(*a, **kw):
            self.n["reduce_scatter"] += 1
            return rs(*a, **kw)

        def all_gather(*a, **kw):
            self.n["all_gather"] += 1
            return ag(*a, **kw)

        setattr(dist, REDUCE_SCATTER, reduce_scatter)
        setattr(dist, ALL_GATHER, all_gather)
        return self

    def __exit__(self, *exc):
        setattr(dist, REDUCE_SCATTER, self.real[0])
        setattr(dist, ALL_GATHER, self.real[1])


def _train(out: str, overrides: list[str], resume: str | None = None):
    if any(o.startswith("loss.router_aux_coef") for o in overrides):
        model, tok = tiny_moe()
    else:
        model, tok = tiny(torch.float32 if 'model.dtype="float32"' in overrides else torch.float64)
    backend = FakeBackend(len(tok), tok.eos_token_id).sides() if "rollout.max_staleness=1" in overrides else None
    if resume:
        t = trainer.Trainer(config.load(os.path.join(resume, "config.toml"), overrides), run_dir=resume,
                            resume=True, model=model, tokenizer=tok)
    else:
        t = trainer.Trainer(run_cfg(out, *overrides), model=model, tokenizer=tok, backend=backend)
    t.sequences_per_call = []  # how many sequences this rank trained in each engine call
    backward = t.parts.learner.engine.backward

    def counted(model, sequences, *a, **kw):
        t.sequences_per_call.append(len(sequences))
        return backward(model, sequences, *a, **kw)

    t.parts.learner.engine.backward = counted
    t.run()
    return t


def ranks_job(tmp: str) -> dict:
    """Every check that needs the 2-rank job, in one launch (each launch costs seconds of imports)."""
    res: dict = {"rank": int(os.environ["RANK"])}
    # 1. a global batch that does not split over the ranks: refused before the group or the folder exist
    try:
        _train(os.path.join(tmp, "bad"), ["train.prompts_per_step=3"])
    except ValueError as e:
        res["bad_input"] = str(e)
    res["bad_written"] = os.path.exists(os.path.join(tmp, "bad"))
    res["group_started"] = collectives.active()
    # 2. the runs compared with one process; the reductions counted
    for name, extra in CASES.items():
        with Counter() as c:
            t = _train(os.path.join(tmp, name), extra)
        res[name] = {"weights": full_weights(t.model), "counts": dict(c.n), "units": _trainable_units(t.model),
                     "sequences_per_call": t.sequences_per_call,
                     "ref_units": len(fsdp.units(t.parts.ref)) if t.parts.ref is not None else 0,
                     "optimizer_steps": STEPS * t.cfg.update.epochs * t.cfg.update.minibatches,
                     "prompts_drawn": t.parts.source.stream.position}
    # 3. resume on 2 ranks from the checkpoint of step 1 of "stream" (step 2's removed): step 2 again
    src, split = os.path.join(tmp, "stream"), os.path.join(tmp, "resumed")
    if collectives.is_main():
        shutil.copytree(src, split)
        shutil.rmtree(os.path.join(split, "checkpoints", f"step-{STEPS}"))
    dist.barrier()
    t = _train(split, [], resume=split)
    res["resumed"] = full_weights(t.model)
    # 4. the run folder on "node-local" storage: each rank looks for rank 0's marker under its own
    # folder (as two nodes' local disks would be); rank 1 does not see it, every rank stops
    local = os.path.join(tmp, f"local-{res['rank']}")
    os.makedirs(local, exist_ok=True)
    if collectives.is_main():
        with open(os.path.join(local, "marker"), "w") as f:
            f.write("rank 0's lock")
    try:
        collectives.check_shared(local, os.path.join(local, "marker"))
    except ValueError as e:
        res["not_shared"] = str(e)
    collectives.check_shared(tmp, os.path.join(tmp, "stream", "config.toml"))  # a folder both see: passes
    # 5. a rank that fails mid-step (rank 1's reward function raises at step 2): every rank stops with
    # a message, in seconds, and no checkpoint of that step is written. Last: it ends the group.
    t0 = time.perf_counter()
    try:
        _train(os.path.join(tmp, "fails"), ["train.save_every=1",
                                            "reward.functions=['distributed_workers:fails_on_rank_1']"])
    except Exception as e:  # noqa: BLE001
        res["failure"] = f"{type(e).__name__}: {e}"
    res["failure_s"] = time.perf_counter() - t0
    return res


_CALLS = [0]


def fails_on_rank_1(completions, **kw):
    """A reward function that breaks on rank 1 at its second call (step 2)."""
    _CALLS[0] += 1
    if os.environ.get("RANK") == "1" and _CALLS[0] == 2:
        raise RuntimeError("reward server unreachable")
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def flat_for_half(completions, prompts, **kw):
    """No signal in the groups of about half the prompts (dynamic sampling drops and refills them);
    elsewhere a reward that differs between almost any two completions (a function of the sample
    alone: a rank scores only its share)."""
    return [0.5 if sum(map(ord, p)) % 2 else sum(map(ord, c)) % 7 / 7 for c, p in zip(completions, prompts)]


def _trainable_units(model) -> int:
    """FSDP units that own a parameter that requires grad: each reduces once per optimizer step."""
    n = 0
    for u in fsdp.units(model):
        groups = u._get_fsdp_state()._fsdp_param_groups
        n += any(p.sharded_param.requires_grad for g in groups for p in g.fsdp_params)
    return n


def single_process_reference(tmp: str, names: list[str], store: str) -> dict:
    """The same runs in one process, in distributed mode with a process group of one (the same
    per-group sampling as N ranks; a plain process samples from one generator instead), and the
    resume of the 2-rank checkpoint of step 1 on this one rank."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (2 threads of tiny matmuls only contend on a busy machine)
    try:
        out = {}
        for name in names:
            t = _train(os.path.join(tmp, "one-" + name), CASES[name])
            out[name] = full_weights(t.model)
            out[name + "/prompts_drawn"] = t.parts.source.stream.position
        src = os.path.join(tmp, "stream")
        dst = os.path.join(tmp, "one-from-two")
        shutil.copytree(src, dst)
        shutil.rmtree(os.path.join(dst, "checkpoints", f"step-{STEPS}"))
        t = _train(dst, [], resume=dst)
        out["from_two"] = full_weights(t.model)
        return out
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def vllm_job(out: str, overrides: list[str]) -> dict:
    """A run on the vLLM backend on this rank (tests/rl/vllm/): its first server's URL and log as this rank
    saw them, whether this rank started it (rank 0; the others are its clients) and whether its process is
    gone after the run, how many times the weights were published and how, every server's URL; then a
    request that only rank 1 sends to the stopped server: the error every rank raises."""
    from backstream.rl.backends.vllm.server import Server, ServerError

    t = trainer.Trainer(config.load(None, [f'train.output_dir="{out}"', *overrides]))
    weights, seen = t.parts.sampling.weights, {}

    def recorded():  # the servers as the run leaves them (stopped last built first: before the servers)
        seen.update(servers=[(m.server.url, m.server.proc, m.server.log_path) for m in weights.pool.members],
                    published=weights.published, kind=weights.kind)

    t.parts.sampling.closing.callback(recorded)
    shares = []  # the number of groups of each `sample` call of this rank (training, then [eval])
    for s in [t.sampler, *([t.parts.evaluator.sampler] if hasattr(t.parts.evaluator, "sampler") else [])]:
        s.sample = _counted(s.sample, shares)
    t.run()
    url, proc, log = seen["servers"][0]
    res = {"url": url, "log": log, "started": proc is not None, "stopped": proc is None or proc.poll() is not None,
           "version": seen["published"], "shares": shares, "kind": seen["kind"],
           "urls": [u for u, _, _ in seen["servers"]]}
    dist.barrier()  # rank 0 has stopped its servers
    error = None
    try:
        if collectives.rank() == 1:
            Server(url, None, log, 10).post("/v1/completions", {})
    except ServerError as e:
        error = e
    try:
        t.parts.dp.fail_together(error)  # what the rollout source does after a round each rank sampled on its own
    except ServerError as e:
        res["error"] = str(e)
    return res


def _counted(sample, shares: list):
    def counted(rows, *a, **kw):
        shares.append(len(rows))
        return sample(rows, *a, **kw)

    return counted
