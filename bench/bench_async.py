"""Asynchronous training (issue 33): the same run synchronous (rollout.max_staleness = 0) and one or two
steps ahead (k = 1, 2), with the sampler and the learner on separate cores of this machine, so that
the overlap is measured as it would be on two devices:
  the server   `backstream vllm serve default`, started once per task under `taskset -c 0` with vLLM's
               CPU threads bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=0); each run connects to it
               (vllm.url), publishes its initial weights, and labels its tokens from version 0;
  the learner  `backstream train` under `taskset -c 1` with one torch thread (OMP_NUM_THREADS=1); its
               producer's threads, which only wait on HTTP, share that core.
Each run is examples/<task>_default.toml's (`arith`: the defaults) for `--steps` steps. Reported per
run: steps per hour (from the wall time of steps 2..N: step 1 includes the first publish), the
learner's wait for samples (time/rollout) and the sampler's idle time (time/sampler_idle; in the
synchronous loop the server idles for the whole learner phase: prefill + backward + optim + sync), the
staleness, and the reward against steps. The bound on the speed-up is (S + L) / max(S, L), S and L
the synchronous run's sampling (rollout + tool + reward) and learning (prefill + backward + optim +
sync) seconds per step; targets (issue 33): on toolcalc, k = 1 at >= 1.5x the synchronous steps per
hour and >= 85% of the bound, with the reward against steps within the synchronous runs' spread over
`--seeds` seeds.

    python -m bench.bench_async [--tasks toolcalc arith] [--ks 0 1 2] [--steps 30] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"toolcalc": os.path.join(ROOT, "examples", "toolcalc_default.toml"), "arith": None}
SAMPLE = ("rollout", "tool", "reward")
LEARN = ("prefill", "backward", "optim", "sync")


def serve(port: int, log_path: str) -> subprocess.Popen:
    """The server on core 0, once it answers /health."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "backstream", "vllm", "serve", "default", "--port", str(port),
           "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; its log: {log_path}")
        time.sleep(1)
    raise SystemExit(f"the server did not start; its log: {log_path}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


def train(task: str, k: int, seed: int, steps: int, url: str, out: str) -> list[dict]:
    """One run on core 1; its metrics rows."""
    sets = [f"train.steps={steps}", f"train.seed={seed}", f"train.output_dir={out}", 'rollout.backend="vllm"',
            f'vllm.url="{url}"', f"rollout.max_staleness={k}", "train.plots=false", "train.progress=false",
            "train.save_every=0", 'data.task="arith"' if task == "arith" else ""]
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "backstream", "train",
           *([CONFIGS[task]] if CONFIGS[task] else []), *[a for s in sets if s for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def summary(rows: list[dict]) -> dict:
    later = rows[1:]  # step 1 includes the first publish (and a url server's first requests)
    mean = lambda key: sum(r.get(key) or 0.0 for r in later) / len(later)  # noqa: E731
    step = mean("time/step")
    return {"steps_per_hour": 3600 / step, "step_s": step, "sample_s": sum(mean(f"time/{p}") for p in SAMPLE),
            "learn_s": sum(mean(f"time/{p}") for p in LEARN), "learner_wait_s": mean("time/rollout"),
            # the synchronous loop's server idles while the learner learns
            "sampler_idle_s": mean("time/sampler_idle") if "time/sampler_idle" in rows[0] else None,
            "staleness_mean": mean("rollout/staleness_mean"),
            "staleness_max": max(r["rollout/staleness_max"] for r in rows),
            "reward": [r["reward/mean"] for r in rows], "step_end_s": [r["time/step"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["toolcalc", "arith"], choices=list(CONFIGS))
    ap.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of k = 0 and 1 on the first task (the reward spread)")
    args = ap.parse_args()
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_async needs taskset and two cores (one for the server, one for the learner)")
    work = tempfile.mkdtemp(prefix="bench-async-")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    results = {"cpu": cpu, "steps": args.steps, "runs": {}}
    for t_i, task in enumerate(args.tasks):
        port = 8700 + t_i
        server = serve(port, os.path.join(work, f"vllm-{task}.log"))
        try:
            for k in args.ks:
                seeds = range(args.seeds) if t_i == 0 and k <= 1 else range(1)
                for seed in seeds:
                    rows = train(task, k, seed, args.steps, f"http://127.0.0.1:{port}",
                                 os.path.join(work, f"{task}-k{k}-s{seed}"))
                    s = results["runs"][f"{task}/k{k}/seed{seed}"] = summary(rows)
                    print(f"{task} k={k} seed={seed}: {s['steps_per_hour']:.0f} steps/h, step {s['step_s']:.2f} s "
                          f"(sampling {s['sample_s']:.2f} s, learning {s['learn_s']:.2f} s, learner waits "
                          f"{s['learner_wait_s']:.2f} s, sampler idle {s['sampler_idle_s'] or s['learn_s']:.2f} s), "
                          "staleness mean "
                          f"{s['staleness_mean']:.2f} max {s['staleness_max']:.0f}, reward first/last 5 steps "
                          f"{sum(s['reward'][:5]) / 5:.3f} / {sum(s['reward'][-5:]) / 5:.3f}", flush=True)
        finally:
            stop(server)
        sync = [v for key, v in results["runs"].items() if key.startswith(f"{task}/k0/")]
        if sync:
            S = sum(v["sample_s"] for v in sync) / len(sync)
            L = sum(v["learn_s"] for v in sync) / len(sync)
            base = sum(v["steps_per_hour"] for v in sync) / len(sync)
            bound = (S + L) / max(S, L)
            results[f"{task}/bound"] = bound
            for k in args.ks[1:] if args.ks[0] == 0 else args.ks:
                runs = [v for key, v in results["runs"].items() if key.startswith(f"{task}/k{k}/")]
                speed = sum(v["steps_per_hour"] for v in runs) / len(runs) / base
                results[f"{task}/k{k}/speedup"] = speed
                print(f"{task}: k={k} {speed:.2f}x the synchronous steps per hour; the bound (S + L) / max(S, L) = "
                      f"({S:.2f} + {L:.2f}) / {max(S, L):.2f} = {bound:.2f}x: {speed / bound:.0%} of it", flush=True)
    common.save("async", results)
    plot(results, args.tasks)
    print(f"runs in {work}")


def plot(results: dict, tasks: list[str]) -> None:
    """bench/results/async.png: per task, the reward against steps and against wall time, each run."""
    try:
        import matplotlib  # extra `plot`

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), squeeze=False)
    colors = {0: "black", 1: "tab:blue", 2: "tab:orange"}
    for row, task in zip(axes, tasks):
        for key, run in results["runs"].items():
            if not key.startswith(f"{task}/"):
                continue
            k = int(key.split("/")[1][1:])
            wall = [sum(run["step_end_s"][:i + 1]) for i in range(len(run["step_end_s"]))]
            label = f"k = {k}" if key.endswith("seed0") else None
            style = {"color": colors.get(k, "gray"), "alpha": 0.8, "label": label}
            row[0].plot(range(1, len(run["reward"]) + 1), run["reward"], **style)
            row[1].plot(wall, run["reward"], **style)
        row[0].set(title=f"{task}: reward against steps", xlabel="step", ylabel="reward/mean")
        row[1].set(title=f"{task}: reward against wall time", xlabel="seconds", ylabel="reward/mean")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, "async.png"), dpi=90)


if __name__ == "__main__":
    main()
