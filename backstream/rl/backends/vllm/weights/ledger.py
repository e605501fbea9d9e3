"""What proves that a publish landed (torch and the standard library only: the learner and the vLLM
worker import it alike). The learner sends tensors under their Hugging Face names; the server's
worker records, for the publish, the fingerprint of every tensor handed to the model's `load_weights`
and the parameters `load_weights` said it loaded. The publish is checked against it: the version, every
tensor sent with the fingerprint it was sent with, every parameter of the model loaded (but those a
server of another class keeps as served, which its own checkpoint filled: names.py). A checksum of
the server's parameters cannot do it on a CPU server (its linear weights live only inside the packed
GEMM, empty tensors as parameters), nor show a head that kept an old packed copy.

`fingerprint(t)`: the number of elements and the float64 sum of 4,096 elements spread over the tensor
(every ⌈n / 4096⌉-th): computed in one order on both sides, equal bit for bit for equal bytes, and
changed by any optimizer step, at the cost of a strided read."""

from __future__ import annotations

SAMPLES = 4096


def fingerprint(t) -> tuple[int, float]:
    """(numel, the float64 sum of every ⌈numel / SAMPLES⌉-th element) of a tensor."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0, 0.0
    step = -(-n // SAMPLES)
    return n, float(flat[::step].double().sum())


def compare(sent: dict[str, tuple[int, float]], received: dict, version: str, where: str) -> list[str]:
    """What is wrong with a server's record of a publish (`received`: its worker's ledger; its version
    None where the way it came carries none, vLLM's IPC engine) against what the learner sent: [] when
    it holds the learner's weights."""
    problems = []
    if received.get("version") is not None and received.get("version") != version:
        problems.append(f"{where} recorded publish {received.get('version')!r}, not {version!r}")
        return problems
    got = {k: tuple(v) for k, v in received.get("fingerprints", {}).items()}
    missing = sorted(set(sent) - set(got))
    if missing:
        problems.append(f"{where} did not receive {len(missing)} of the {len(sent)} tensors sent, e.g. {missing[:3]}")
    differ = sorted(k for k in set(sent) & set(got) if got[k] != tuple(sent[k]))
    if differ:
        problems.append(f"{where} received other values than were sent for {len(differ)} tensors, e.g. {differ[:3]}")
    unloaded = received.get("unloaded", [])
    if unloaded:
        problems.append(f"{where} kept its old weights in {len(unloaded)} parameters (load_weights did not load "
                        f"them), e.g. {unloaded[:3]}")
    return problems
