"""The package's rooms: its import graph (every `import` in every module, those inside functions
included) has no circle, and the streamed-backward library (`backstream.stream`) imports nothing from
the RL loop (`backstream.rl`) or quantization (`backstream.quant`). Read from the source, not by
importing it, so that a lazy import counts too."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import backstream

ROOT = pathlib.Path(backstream.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The backstream modules `name` imports (a name imported from a package that is a module of
    its own counts as that module; the root package itself is left out: importing any submodule
    runs it, which is Python's doing, not a dependency)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != "backstream"}
    return out - {name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_library_imports_no_application():
    g = graph()
    library = [m for m in g if m.startswith("backstream.stream")]
    assert "backstream.stream.engine" in library and "backstream.stream.fsdp" in library
    bad = {m: sorted(n for n in g[m] if n.startswith(("backstream.rl", "backstream.quant", "backstream.trainer",
                                                        "backstream.config", "backstream.cli")))
           for m in library}
    assert not {m: v for m, v in bad.items() if v}, bad


def test_fsdp_and_hf_are_leaves():
    """FSDP2 lives in one module that imports nothing of the engine; the model-introspection module
    imports nothing of backstream at all (so importing it registers or patches nothing)."""
    g = graph()
    assert g["backstream.checks"] == set()  # UserError and the config checks: a leaf every room may use
    assert g["backstream.stream.hf"] <= {"backstream.checks"}
    assert g["backstream.stream.fsdp"] <= {"backstream.stream.hf", "backstream.checks"}


def test_the_walk_sees_lazy_imports():
    """The walk is not blind: the CLI imports the trainer inside a function only."""
    assert "backstream.trainer" in graph()["backstream.cli"]


def test_one_rollout_layer():
    """The samplers (rl/rollout/) take a backend (rl/backends/base.py's protocols) and import no concrete
    one (rl/backends/local/, rl/backends/vllm/: the run builds it, rl/backends/__init__.py); nothing of
    rl/agent/ imports rl/backends/vllm/ and nothing of rl/backends/vllm/ imports rl/agent/; process
    lifetime is one module of the standard library alone."""
    g = graph()

    def room(prefix):
        return [m for m in g if m == prefix or m.startswith(prefix + ".")]

    agent, vllm = room("backstream.rl.agent"), room("backstream.rl.backends.vllm")
    rollout = room("backstream.rl.rollout")
    assert agent and vllm and rollout
    assert not {m: sorted(n for n in g[m] if n in vllm) for m in agent if g[m] & set(vllm)}
    assert not {m: sorted(n for n in g[m] if n in agent) for m in vllm if g[m] & set(agent)}
    concrete = {*room("backstream.rl.backends.local"), *vllm, "backstream.rl.backends"}
    for m in (*rollout, *agent):
        assert not g[m] & concrete, (m, sorted(g[m] & concrete))
    assert g["backstream.lifetime"] == set()


SERVER_SIDE = ["backstream.rl.backends.vllm.worker_ext", "backstream.rl.backends.vllm.weights.receive",
               "backstream.quant.export", "backstream.quant.linear"]


def _import_under(version: str, module: str) -> subprocess.CompletedProcess:
    code = f"import transformers; transformers.__version__ = {version!r}; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_transformers_floor_holds_on_the_learner_side_only():
    """The engine and the sampler refuse a transformers older than 5.23 by name (a GPU image's 5.17
    failed inside an import: `DummyLayer`); what vLLM's own environment imports (the server's side,
    with vLLM's transformers, 5.19 on the CPU build) does not ask for it: a check at the package's root
    broke every vLLM server."""
    for module in ("backstream.stream.engine", "backstream.rl.backends.local.decode"):
        proc = _import_under("5.17.0", module)
        assert proc.returncode != 0 and "backstream needs transformers >= 5.23, this environment has 5.17.0" in \
            proc.stderr, (module, proc.stderr[-2000:])
    proc = _import_under("5.19.0", "; import ".join(SERVER_SIDE))
    assert proc.returncode == 0, proc.stderr[-2000:]
