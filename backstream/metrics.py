"""Observability: one line per step, `metrics.jsonl`, optional TensorBoard / W&B, PNG curves.

The loop calls one `Logger` whatever is enabled; optional backends are imported lazily and only
when asked for, so the loop never branches on them.
"""

from __future__ import annotations

import json
import os
import sys
import uuid


def check_backends(tensorboard: bool, wandb: bool) -> None:
    """Fail before the run folder is written if an asked-for backend is not installed."""
    import importlib.util  # noqa: PLC0415

    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("train.log_tensorboard: needs `pip install tensorboard` (or 'backstream[log]'); "
                         "or set it to false")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("train.log_wandb: needs `pip install wandb` (or 'backstream[log]'); or set it to false")


def _keep_steps_up_to(path: str, step: int) -> None:
    """On resume from the checkpoint of `step`: keep the lines of steps ≤ `step` and drop the rest
    (steps that will run again, and a line a kill cut short), so that no line is lost or doubled.
    Rewritten under a temporary name and renamed into place."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # cut short by a kill
            if line.endswith("\n") and row.get("step", step + 1) <= step:
                kept.append(line)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Logger:
    def __init__(self, run_dir: str, *, progress=True, tensorboard=False, wandb=False, config: dict | None = None,
                 total_steps: int | None = None, append: bool = False, wandb_project: str = "backstream",
                 start_step: int = 0):
        check_backends(tensorboard, wandb)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if append:
            _keep_steps_up_to(self.path, start_step)
        self.file = open(self.path, "a" if append else "w")
        self.progress, self.total = progress, total_steps
        self.bar = None
        if progress and getattr(sys.stderr, "isatty", lambda: False)():
            # a terminal gets a redrawing bar; a log file gets one line per step
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total_steps, initial=start_step, file=sys.stderr, unit="step", dynamic_ncols=True)
        self.tb = self.wb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb:
            import wandb as wb  # noqa: PLC0415

            # the run id lives in the run folder, so that --resume continues the same W&B run
            id_path = os.path.join(run_dir, "wandb_id.txt")
            if append and os.path.exists(id_path):
                run_id = open(id_path).read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]
                with open(id_path, "w") as f:
                    f.write(run_id + "\n")
            self.wb = wb.init(project=wandb_project, id=run_id, resume="allow", config=config, dir=run_dir,
                              name=os.path.basename(os.path.abspath(run_dir)))

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        step = metrics["step"]
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(metrics, step=step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(self.line(metrics).split(" | ", 1)[1])
        elif self.progress:
            print(self.line(metrics), file=sys.stderr, flush=True)

    def line(self, m: dict) -> str:
        total = f"/{self.total}" if self.total else ""
        t = m.get("time/step", 0.0)
        phases = ("time/rollout", "time/reward", "time/prefill", "time/backward")
        split = " ".join(f"{k.split('/')[1]} {m[k]:.1f}s" for k in phases if k in m)
        # sampler/learner mismatch: k3 KL(sampler‖learner) per token, and the share of error-token responses
        mm = (f" | mismatch kl {m['mismatch/kl']:.1e} err {m.get('mismatch/error_token_share', 0.0):.2f}"
              if "mismatch/kl" in m else "")
        return (f"step {m['step']}{total} | reward {m['reward/mean']:.3f} | len {m['response_length/mean']:.1f} | "
                f"{m.get('throughput/tokens_per_s', 0):.0f} tok/s | {t:.1f}s ({split}) | "
                f"peak {m.get('memory/peak_mib', 0):.0f} MiB{mm}")

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def read(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} is not a run folder (it has no metrics.jsonl): pass the folder a run wrote, "
                         "the train.output_dir of its config")
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


PLOTS = {
    "reward": ["reward/mean"], "length": ["response_length/mean"], "kl": ["loss/kl"],
    "entropy": ["loss/entropy"], "clip_fraction": ["loss/clip_frac_low", "loss/clip_frac_high"],
}


def plot(run_dir: str) -> list[str]:
    """PNG curves of the run's metrics; returns the files written."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("backstream plot: needs `pip install 'backstream[plot]'` (matplotlib)") from None
    rows = read(run_dir)
    out = []
    for name, keys in PLOTS.items():
        series = [(k, [(r["step"], r[k]) for r in rows if k in r]) for k in keys]
        series = [(k, s) for k, s in series if s]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        for k, s in series:
            ax.plot([x for x, _ in s], [y for _, y in s], label=k)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        path = os.path.join(run_dir, f"{name}.png")
        fig.savefig(path)
        plt.close(fig)
        out.append(path)
    return out
