"""The package's rooms: its import graph (every `import` in every module, those inside functions
included) has no circle, no room imports one of a floor above it or beside it (`FLOORS`), and the
streamed-backward library (`backstream.stream`) imports nothing from the RL loop (`backstream.rl`) or
quantization (`backstream.quant`). Read from the source, not by importing it, so that a lazy import
counts too. And what the layout promises a reader: rl/'s top level is at most 10 entries, each with a
one-line docstring; every package's docstring names its modules; no protocol has a member an
implementation leaves as a no-op; no builder of rl/ takes the whole run config; the trainer is a short
sequence of phases (and one sample's path from its step to the streamed backward visits no module
twice: tests/run/test_trainer.py)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import typing

import pytest

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


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    known = modules()
    return {name: frozenset(imports(name, path, known)) for name, path in known.items()}


def graph() -> dict[str, set[str]]:
    """Each module's imports of the package (read once a process)."""
    return {m: set(ns) for m, ns in _graph().items()}


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
               "backstream.quant.compressed", "backstream.quant.linear"]


def _import_under(version: str, module: str) -> subprocess.CompletedProcess:
    code = f"import transformers; transformers.__version__ = {version!r}; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
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


# The floors, lowest first: a module may import its own room's modules and those of the rooms of lower
# floors, nothing of a room beside it or above it. A room is a folder of rl/ (backstream.rl.rollout), the
# library (backstream.stream), quantization (backstream.quant), or one top-level module.
FLOORS = [
    ["backstream.checks", "backstream.log"],  # the errors, the logger: every room's
    ["backstream.lifetime", "backstream.usercode", "backstream.default_model", "backstream.metrics",
     "backstream.checkpoint"],  # leaves of the standard library, torch or the two above
    ["backstream.stream", "backstream.tiny_vlm"],  # the streamed-backward library; the tiny VLM over the default model
    ["backstream.quant"],  # low-bit formats and layers, the compressed-tensors writer
    ["backstream.rl", "backstream.rl.records"],  # the rl/ map (a docstring), the records its rooms share
    ["backstream.rl.parallel", "backstream.rl.policy", "backstream.rl.scoring", "backstream.rl.agent"],
    ["backstream.rl.data", "backstream.rl.backends"],
    ["backstream.rl.rollout", "backstream.rl.update"],  # who asks for samples, who learns: peers
    ["backstream.config"],  # the run's config: every section
    ["backstream.parts", "backstream.runfolder", "backstream.export"],
    ["backstream.trainer"],
    ["backstream.cli", "backstream"],
    ["backstream.__main__"],
]


def room(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["backstream", "rl"] and len(parts) > 2:
        return ".".join(parts[:3])
    if parts[:2] in (["backstream", "stream"], ["backstream", "quant"]):
        return ".".join(parts[:2])
    return module


def test_no_import_goes_up_or_sideways():
    g = graph()
    floor = {r: i for i, rooms in enumerate(FLOORS) for r in rooms}
    rooms = {room(m) for m in g}
    assert rooms == set(floor), f"rooms without a floor: {sorted(rooms - set(floor))}; floors of no room: " \
                                f"{sorted(set(floor) - rooms)}"
    bad = sorted(f"{m} -> {n}" for m, ns in g.items() for n in ns
                 if room(n) != room(m) and floor[room(n)] >= floor[room(m)])
    assert not bad, bad


RL = ROOT / "rl"


def _docstring(path: pathlib.Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text()))


def test_rl_top_level_is_a_map():
    """At most 10 entries (modules, folders), each opening with a one-line summary; every package's
    docstring names each of its modules and subfolders."""
    entries = sorted(p for p in RL.iterdir() if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    assert len(entries) <= 10, [p.name for p in entries]
    for p in entries:
        doc = _docstring(p / "__init__.py" if p.is_dir() else p)
        assert doc and doc.split("\n")[0].strip(), f"{p.name}: no docstring"
    for init in [*ROOT.rglob("__init__.py")]:
        folder = init.parent
        if folder == ROOT:
            continue
        doc = _docstring(init) or ""
        names = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
        names += [p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        missing = [n for n in names if not re.search(rf"(?<![\w/.]){re.escape(n)}(?![\w])", doc)]
        assert not missing, f"{folder.relative_to(ROOT.parent)}/__init__.py does not name {missing}"


TRIVIAL = (ast.Pass, ast.Constant)


def _is_no_op(fn: ast.FunctionDef) -> bool:
    """A body of a docstring, `pass`, `...`, or a `return` of a constant or an empty container."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return True
    if len(body) == 1 and isinstance(body[0], ast.Pass):
        return True
    if len(body) == 1 and isinstance(body[0], ast.Return):
        v = body[0].value
        return v is None or isinstance(v, ast.Constant) or (isinstance(v, (ast.Dict, ast.List, ast.Tuple, ast.Set))
                                                             and not getattr(v, "keys", v.elts if hasattr(v, "elts")
                                                                             else []))
    return False


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((str(path.relative_to(ROOT.parent)), node))
    return out


def test_no_protocol_member_is_left_a_no_op():
    """For every typing.Protocol of the package, every class that implements all of its methods (by
    name) implements none of them as a no-op: what only some implementations do is a protocol of its
    own (rl/backends/base.py's `Preflight`, `Aligned`, `Resting`, `Reporter`)."""
    classes = _classes()
    protocols = {c.name: [f.name for f in c.body if isinstance(f, ast.FunctionDef)] for _, c in classes
                 if any(getattr(b, "id", getattr(b, "attr", None)) == "Protocol" for b in c.bases)}
    assert {"Backend", "Requests", "Weights", "Preflight", "Aligned", "Resting", "Reporter", "Sampler",
            "LayerState"} <= set(protocols)
    seen, bad = 0, []
    for where, c in classes:
        if c.name in protocols:
            continue
        methods = {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}
        for proto, members in protocols.items():
            if members and set(members) <= set(methods):
                seen += 1
                bad += [f"{where} {c.name}.{m} ({proto})" for m in members if _is_no_op(methods[m])]
    assert seen >= 12  # the local and server backends, their weights, the samplers, the layer states...
    assert not bad, bad


SECTION_NAMES = {"model", "data", "rollout", "env", "reward", "algorithm", "update", "loss", "optim", "engine",
                 "train", "eval", "quant", "distributed", "vllm"}


def test_no_builder_in_rl_takes_the_run_config():
    """A function of rl/ takes the sections it needs, never the whole RunConfig: no parameter of one is
    read for two sections (`cfg.rollout` and `cfg.vllm`) nor annotated RunConfig."""
    from backstream.config import SECTIONS

    assert set(SECTIONS) == SECTION_NAMES
    bad = []
    for path in RL.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = {a.arg: a for a in [*fn.args.args, *fn.args.kwonlyargs]}
            read: dict[str, set] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                        node.value.attr in SECTION_NAMES:
                    base = node.value.value  # cfg.rollout.x (a parameter) or self.cfg.rollout.x (one kept)
                    name = base.id if isinstance(base, ast.Name) and base.id != "self" else \
                        f"self.{base.attr}" if isinstance(base, ast.Attribute) and base.attr in ("cfg", "config") \
                        else None
                    if name is not None:
                        read.setdefault(name, set()).add(node.value.attr)
            for name, sections in read.items():
                if len(sections) > 1 and (name in params or name.startswith("self.")):
                    bad.append(f"{path.relative_to(ROOT.parent)} {fn.name}: {name} read for {sorted(sections)}")
            for a in params.values():
                if a.annotation is not None and "RunConfig" in ast.unparse(a.annotation):
                    bad.append(f"{path.relative_to(ROOT.parent)} {fn.name}: {a.arg}: RunConfig")
    assert not bad, bad


def test_the_trainer_is_a_short_sequence_of_phases():
    """The trainer's parts are built by one function into a typed bundle (backstream/parts.py): the
    trainer is at most 350 lines, its __init__ at most 30, and the step calls the phases in order."""
    from backstream import parts, trainer

    assert len(inspect.getsource(trainer).splitlines()) <= 350
    assert len(inspect.getsource(trainer.Trainer.__init__).splitlines()) <= 30
    assert dataclasses.is_dataclass(parts.Parts)
    hints = typing.get_type_hints(parts.Parts)
    assert {"sampling", "sampler", "source", "collector", "rewards", "learner", "evaluator"} <= set(hints)
    step = inspect.getsource(trainer.Trainer.train_step)
    order = [step.index(s) for s in ("self.collect()", "self.advantages(", "learner.update(", "source.at_step(",
                                      "self.metrics(")]
    assert order == sorted(order)
    importlib.import_module("backstream.rl.update.learner")
