"""Distributed checkpoints (FSDP2 + torch.distributed.checkpoint) on two gloo ranks: resume on as
many ranks is bitwise, the Hugging Face export beside the shards loads with `from_pretrained`, a
2-rank checkpoint resumes in one process and a one-process checkpoint on 2 ranks (float tolerance),
a full disk on one rank leaves no checkpoint on any, and what cannot be loaded says why.

One launch of 2 processes does the distributed work for every test (spawning and importing
dominate); the tests check what it returned and the folders it wrote."""

import json
import os
import pickle
import shutil
import warnings

import dcp_workers as w
import dist
import pytest
import torch
from transformers import LlamaForCausalLM

from backstream import checkpoint

warnings.filterwarnings("ignore", category=FutureWarning)


def _single_process_checkpoint(run: str, lora: bool) -> dict:
    """The same 2 steps in one process (the mean of both ranks' losses), saved, then the third."""
    model, tok = w.build(lora)
    opt, sched = w.optimizer(model)
    for i in (1, 2):
        w.step(model, opt, sched, i, [0, 1])
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint.save(run, 2, model, tok, w.state(torch.Generator(), opt, sched, 2, 0), keep=2)
    w.step(model, opt, sched, 3, [0, 1])
    return {"at_save": saved, "after": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    single = {lora: _single_process_checkpoint(str(root / "single" / ("lora" if lora else "full")), lora)
              for lora in (False, True)}
    ranks = dist.run(w.train_save_resume, 2, str(root / "two"), str(root / "single"))
    return {"root": root, "single": single, "ranks": ranks}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _close(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("lora", [False, True])
def test_resume_on_as_many_ranks_is_bitwise(runs, lora):
    r0, r1 = (r[lora] for r in runs["ranks"])
    _equal(r0["after_resume"][0], r0["after"][0])  # the third step, from the restored state, bitwise
    for rank, r in enumerate((r0, r1)):
        assert r["restored"] == {"step": 2, "data_position": 10 * rank + 2, "world_size": 2}  # this rank's own
        assert r["sampler"]
        assert r["lr"] == pytest.approx([w.LR / 3])
    path = r0["path"]
    names = sorted(os.listdir(os.path.join(path, checkpoint.DCP)))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    sizes = json.load(open(os.path.join(path, checkpoint.MANIFEST)))["sizes"]
    assert {f"dcp/{n}" for n in names} <= sizes.keys() and checkpoint.damage(path) is None
    state = checkpoint.load_state(path)
    assert "optimizer" not in state and [s["data_position"] for s in state["ranks"]] == [2, 12]
    if not lora:  # saved before the first step: the optimizer stays unstepped, and is restored so
        assert runs["ranks"][0]["unstepped"] == (True, True, True) and runs["ranks"][1]["unstepped"][:2] == (True, True)


def test_hf_export_loads_with_from_pretrained(runs):
    from peft import PeftModel
    from transformers import AutoTokenizer

    full, lora = runs["ranks"][0][False], runs["ranks"][0][True]
    weights = full["at_save"][0]
    model = LlamaForCausalLM.from_pretrained(full["path"])
    _equal(model.state_dict(), weights)
    assert len(AutoTokenizer.from_pretrained(full["path"])) == 100
    assert not os.path.exists(os.path.join(lora["path"], "model.safetensors"))  # the adapter only, as today
    base, _ = w.build(False)
    model = PeftModel.from_pretrained(base, lora["path"])
    _equal(model.state_dict(), lora["at_save"][0])


@pytest.mark.parametrize("lora", [False, True])
def test_two_rank_checkpoint_in_one_process(runs, lora):
    r = runs["ranks"][0][lora]
    weights, optim = r["at_save"]
    model, _ = w.build(lora)
    opt, sched = w.optimizer(model)
    st = checkpoint.restore(r["path"], model, opt, sched)  # no process group
    assert (st["step"], st["data_position"], st["world_size"]) == (2, 2, 2)  # rank 0's
    _close(model.state_dict(), weights)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    got = get_optimizer_state_dict(model, opt)["state"]
    assert got.keys() == optim.keys()
    for k in got:
        _close(got[k], optim[k])
    w.step(model, opt, sched, 3, [0, 1])  # what the 2 ranks did together
    _close(model.state_dict(), r["after"][0])


@pytest.mark.parametrize("lora", [False, True])
def test_one_process_checkpoint_on_two_ranks(runs, lora):
    r, single = runs["ranks"][0][lora]["single"], runs["single"][lora]
    assert (r["step"], r["world_size"]) == (2, 1)
    weights, optim = r["at_restore"]
    _equal(weights, single["at_save"])
    assert all(float(s["step"]) == 2 for s in optim.values())
    _close(r["after"][0], single["after"])


@pytest.mark.parametrize("lora", [False, True])
def test_one_process_restore_in_one_process_is_bitwise(runs, lora):
    model, _ = w.build(lora)
    opt, sched = w.optimizer(model)
    st = checkpoint.restore(os.path.join(runs["root"], "single", "lora" if lora else "full", "checkpoints", "step-2"),
                            model, opt, sched)
    assert (st["step"], st["data_position"], st["world_size"]) == (2, 2, 1) and "optimizer" not in st
    w.step(model, opt, sched, 3, [0, 1])
    _equal(model.state_dict(), runs["single"][lora]["after"])


def test_a_full_disk_on_one_rank_leaves_no_checkpoint_on_any(runs):
    for lora, failing in ((False, 1), (True, 0)):
        for rank, r in enumerate(runs["ranks"]):
            fd = r[lora]["full_disk"]
            no, msg = fd["error"]
            assert no == 28 and f"writing step 3 failed on rank {failing} (No space left on device)" in msg
            assert "the latest checkpoint is still" in msg and msg.endswith("step-2"), msg
            assert fd["names"] == ["step-2"]  # no step-3, no temporary folder, as every rank sees it
            assert fd["latest"].endswith("step-2")


def test_what_cannot_be_loaded_says_why(runs, tmp_path):
    two = runs["ranks"][0][False]["path"]
    model, _ = w.build(False)
    opt, _ = w.optimizer(model)

    # a shard that never reached this disk
    broken = shutil.copytree(two, tmp_path / "broken")
    os.remove(broken / "dcp" / "__1_0.distcp")
    assert checkpoint.damage(str(broken)) == "dcp/__1_0.distcp is missing"
    with pytest.raises(ValueError, match=r"restore: .*broken cannot be loaded: dcp/__1_0.distcp is missing\. It was "
                                         r"written by 2 ranks, .*copy every rank's dcp/ files into"):
        checkpoint.restore(str(broken), model, opt)

    # another architecture: 3 layers, from the shards and from a one-process checkpoint's files
    other, _ = w.build(False, layers=3)
    other_opt, _ = w.optimizer(other)
    single = os.path.join(runs["root"], "single", "full", "checkpoints", "step-2")
    for path in (two, single):
        with pytest.raises(ValueError, match=r"holds the weights of another model than the one given: .*absent "
                                             r"\(model.layers.2.*It was written from LlamaForCausalLM \(2 layers.*"
                                             r"the model given is LlamaForCausalLM \(3 layers"):
            checkpoint.restore(path, other, other_opt)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter \(r=4\) and the model given has no LoRA layers"):
        checkpoint.restore(runs["ranks"][0][True]["path"], model, opt)

    # a .metadata that would run code when unpickled is refused
    evil = shutil.copytree(two, tmp_path / "evil")
    with open(evil / "dcp" / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(), f)
    manifest = json.load(open(evil / checkpoint.MANIFEST))
    manifest["sizes"]["dcp/.metadata"] = os.path.getsize(evil / "dcp" / ".metadata")
    json.dump(manifest, open(evil / checkpoint.MANIFEST, "w"))
    with pytest.raises(ValueError, match=r"a \.metadata that names posix\.system; it was refused"):
        checkpoint.restore(str(evil), model, opt)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))
