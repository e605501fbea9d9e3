"""stream_backward, reference_backward and logprobs under FSDP2 on 2 gloo processes (docs/design.md §6c):
each rank holds its own share of a GRPO-like batch (a different number of block batches), the
gradients are reduced once per unit by SUM, and the gathered result equals the gradient one
process computes on all the sequences. One launch runs every check (tests/fsdp_workers.py)."""

import functools
import warnings

import dist
import fsdp_workers as fw
import pytest
import torch

from backstream import logprobs
from backstream.stream.verify import relative_errors

warnings.filterwarnings("ignore", category=FutureWarning)
TOL = 1e-10


@pytest.fixture(scope="module")
def ranks():
    # one thread for this module's single-process references, as the workers have: tiny float64
    # matmuls are ~100× slower with 2 OpenMP threads on a busy 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dist.run(fw.run_all, 2, init=False)
    torch.set_num_threads(threads)


@functools.cache
def single_process(use_lora):
    return fw.single_process_grads(use_lora)


def assert_close(got: dict, want: dict, what: str) -> float:
    """Relative error per parameter (judged against a thousandth of the largest gradient where the
    true one is ~0, as tests/stream/test_engine.py does); returns the largest."""
    assert got.keys() == want.keys() and got, what
    worst = 0.0
    for n, err in relative_errors(got, want).items():
        assert err <= TOL, f"{what}: {n}: relative error {err:.3g}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("use_lora, reshard", fw.CONFIGS)
def test_fsdp_gradients_counts_and_logprobs(ranks, use_lora, reshard):
    res = [r[use_lora, reshard] for r in ranks]
    assert res[0]["batches"] != res[1]["batches"]  # the ranks ran different numbers of block batches

    # gradients: the sum over ranks equals one process on everything (rank 1 idle: rank 0's alone;
    # "empty": rank 0 ran both the streamed and the reference backward, rank 1 had no sequence)
    alone, both = single_process(use_lora)
    grads = res[0]["grads"]
    assert_close(grads["stream"], both, "stream_backward")
    assert_close(grads["reference"], both, "reference_backward")
    assert_close(grads["idle"], alone, "rank 1 idle")
    assert_close(grads["empty"], {n: 2 * g for n, g in alone.items()}, "rank 1 without sequences")

    # one reduce-scatter per unit with trainable parameters (LoRA: the root unit holds none), and
    # no all-gather beyond one per unit at the start of a call, however many block batches ran
    units = 2 if use_lora else 3
    for r in res:
        c = r["counts"]
        assert c["raised"] == (0, 3) and c["logprobs"] == (0, 3)
        assert c["stream"] == c["reference"] == (units, 3)
        assert c["idle"] == (units, 3 if reshard else 0)  # after logprobs, the units stayed gathered
        assert c["empty"] == (2 * units, 9 if reshard else 6)  # logprobs, stream (none if gathered), reference

    # a call leaves every unit's settings as it found them (after an exception too), and the
    # parameters sharded as FSDP would: after a backward always; after logprobs, as reshard_after_forward says
    for r in res:
        assert r["raised"] == "objective failed"
        s = r["settings"]
        flags = lambda name: [unit[:-1] for unit in s[name]]  # noqa: E731
        assert all(flags(name) == flags("before") for name in s)
        for name in ("before", "raised", "stream", "reference", "idle"):
            assert all(state[-1] == "SHARDED" for state in s[name]), name
        assert all(state[-1] == ("SHARDED" if reshard else "UNSHARDED") for state in s["logprobs"])

    # log-probs under FSDP: the single process's values, from the backward and from the no-grad pass
    plain = fw.model(use_lora)
    for rank, r in enumerate(res):
        want = logprobs(plain, fw.share(rank)[0], block_size=fw.BLOCK)
        for a, b in zip(r["logprobs"], want):
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.allclose(a[1:], b[1:], atol=1e-12, rtol=0)
        for a, b in zip(r["logprobs_backward"], want):
            read = ~a.isnan()  # the targets the objective read
            assert read.any() and torch.allclose(a[read], b[read], atol=1e-12, rtol=0)
    assert res[1]["logprobs_empty"] == []


def test_fsdp_float32_sum_reduction_on_gloo(ranks):
    """set_gradient_divide_factor(1.0) alone is a PREMUL_SUM in float32, refused by gloo; with
    set_force_sum_reduction_for_comms(True) it is a SUM: float32 rounding only."""
    _, both = fw.single_process_grads(False, torch.float32)
    got = ranks[0]["float32"]
    assert got.keys() == both.keys()
    for n in both:
        assert (got[n] - both[n]).norm() <= 1e-5 * both[n].norm() + 1e-7, n


def test_fsdp_router_loss_counts_every_rank(ranks):
    """The MoE load-balancing loss under FSDP: f_e and N over both ranks' tokens (one all-reduce), so
    the summed gradients and the loss value are those of one process on all the sequences, with the
    streamed and the reference backward; a rank without sequences still joins the sums."""
    want = fw.single_process_router()
    for name in ("stream", "reference"):
        (grads, aux), (_, aux1) = ranks[0]["moe", name], ranks[1]["moe", name]
        assert_close(grads, want["both"][0], f"router loss, {name}")
        assert abs(aux - want["both"][1]) <= 1e-12 and aux1 == aux  # the global value, on every rank
        (grads, aux), (_, aux1) = ranks[0]["moe", name, "empty"], ranks[1]["moe", name, "empty"]
        assert_close(grads, want["alone"][0], f"router loss, {name}, rank 1 empty")
        assert abs(aux - want["alone"][1]) <= 1e-12 and aux1 == aux
    # not vacuous: each rank with its own counts would give another gradient
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(want["per_rank"][0], want["both"][0], "per-rank counts")


def test_an_fsdp2_without_what_the_engine_needs_is_refused():
    """An older torch's FSDP2 (here: no force-sum reduction, no auto-reshard flag) is refused when the
    model is sharded, naming what is missing, rather than failing mid-step (a UserError: the CLI prints
    it and exits 2, not "a bug in backstream")."""
    import types

    from backstream.checks import UserError
    from backstream.stream.fsdp import FSDPCall

    state = types.SimpleNamespace(_is_root=None, _lazy_init=None, _fsdp_param_groups=[])
    unit = types.SimpleNamespace(_get_fsdp_state=lambda: state,
                                 **{a: None for a in FSDPCall.SETTERS if a != "set_force_sum_reduction_for_comms"})
    with pytest.raises(UserError, match=r"FSDP2 without .*'FSDPState._auto_reshard_after_forward'.*"
                                           r"set_force_sum_reduction_for_comms.*tested with \(2.13\)"):
        FSDPCall.check_supported([unit])
    state._auto_reshard_after_forward = True
    unit.set_force_sum_reduction_for_comms = None
    FSDPCall.check_supported([unit])  # everything there
