"""Observability: one line per step, `metrics.jsonl`, optional TensorBoard / W&B, PNG curves.

The loop calls one `Logger` whatever is enabled; optional backends are imported lazily and only
when asked for, so the loop never branches on them.

Every `metrics.jsonl` line has the same keys, in the same order: the run's `keys` (declared by the
trainer before the first step), `null` where a value is undefined on that step (no loss term when
every advantage was 0, say), and `time/wall`, the local time the step ended (ISO 8601). On a
terminal a bar redraws in place, says which phase of the step is running (`phase`) and fits the
terminal's width; in a log there is one plain line per step.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import shutil
import sys
import uuid

from backstream.checks import UserError
from backstream.log import log


def check_backends(tensorboard: bool, wandb: bool) -> None:
    """Fail before the run folder is written if an asked-for backend is not installed."""
    import importlib.util  # noqa: PLC0415

    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("train.log_tensorboard: needs `pip install tensorboard` (or 'backstream[log]'); "
                         "or set it to false")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("train.log_wandb: needs `pip install wandb` (or 'backstream[log]'); or set it to false")


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


class Progress:
    """The run's progress on stderr (train.progress): a redrawing bar on a terminal, its description what
    the current step is doing (`phase`: "rollout 3/16", "backward 2/4"), or one line per step otherwise
    (`Logger.log`). Built with the run's parts, which report their phases to it; its bar starts with the
    run (`start`, at the step it starts from), and what a phase says before that is not shown."""

    def __init__(self, enabled: bool = True, total_steps: int | None = None):
        self.enabled, self.total, self.bar, self.step = enabled, total_steps, None, 0

    def start(self, step: int) -> None:
        """The run starts after `step` steps: a terminal's bar from there."""
        self.step = step
        if self.enabled and self.bar is None and getattr(sys.stderr, "isatty", lambda: False)():
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=self.total, initial=step, file=sys.stderr, unit="step", dynamic_ncols=True)

    def at(self, step: int) -> None:
        """Step `step` (counted from 1) is being computed."""
        self.step = step

    def phase(self, what: str) -> None:
        """What the current step is doing: on a terminal's bar only."""
        if self.bar is not None:
            self.bar.set_description_str(f"step {self.step}: {what}"[: max(12, _columns() // 3)])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoLogger:
    """The logger of the ranks other than 0 under torchrun: the Logger's and EpisodeLog's methods,
    doing nothing."""

    def log(self, metrics: dict) -> None:
        pass

    def write(self, step: int, rows) -> None:
        pass

    def close(self) -> None:
        pass


class Logger:
    def __init__(self, run_dir: str, *, progress: bool | Progress = True, tensorboard=False, wandb=False,
                 config: dict | None = None, total_steps: int | None = None, append: bool = False,
                 wandb_project: str = "backstream", start_step: int = 0, keys: list[str] | None = None):
        """`keys`: every key a step's line holds (more keys that a step brings are added after them);
        `progress`: the run's `Progress` (a terminal's bar, started here at `start_step`), or whether to
        show one."""
        check_backends(tensorboard, wandb)
        self.keys = ["step", "time/wall", *[k for k in keys or [] if k not in ("step", "time/wall")]]
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if append:
            _keep_steps_up_to(self.path, start_step)
        self.file = open(self.path, "a" if append else "w")
        self.progress = progress if isinstance(progress, Progress) else Progress(progress, total_steps)
        self.total = self.progress.total
        self.progress.start(start_step)  # a terminal gets a redrawing bar; a log file gets one line per step
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
        metrics = {**metrics, "time/wall": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        self.keys += [k for k in metrics if k not in self.keys]
        row = {k: _finite_or_none(metrics.get(k)) for k in self.keys}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        step = metrics["step"]
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in numbers.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log({k: v for k, v in numbers.items() if k != "step"}, step=step)
        if self.bar is not None:
            self.bar.set_description_str(f"step {step}")
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(self._fit(row))
        elif self.progress.enabled:
            print(self.line(row), file=sys.stderr, flush=True)

    @property
    def bar(self):
        return self.progress.bar

    def line(self, m: dict, parts: int = 5) -> str:
        """The step's line; `parts` < 5 leaves out the least telling fields (mismatch, memory, timing).
        A line with no training metrics (the held-out evaluation before step 1) reads as an eval line."""
        total = f"/{self.total}" if self.total else ""
        num = lambda k: m.get(k) if isinstance(m.get(k), (int, float)) else 0.0  # noqa: E731  (null: 0)
        evals = [f"{k.removeprefix('eval/')} {num(k):.3f}" for k in m if k.startswith("eval/") and m.get(k) is not None]
        if m.get("reward/mean") is None and evals:
            return " | ".join([f"eval at step {m['step']}{total}", *evals])
        phases = ("time/rollout", "time/sync", "time/tool", "time/reward", "time/prefill", "time/backward")
        split = " ".join(f"{k.split('/')[1]} {num(k):.1f}s" for k in phases if m.get(k) is not None
                         and (k not in ("time/tool", "time/sync") or num(k) > 0))
        fields = [f"step {m['step']}{total}", f"reward {num('reward/mean'):.3f}",
                  f"len {num('response_length/mean'):.1f}"]
        if m.get("episode/turns/mean") is not None:  # per episode: turns, tool calls, tool errors
            fields.append(f"turns {num('episode/turns/mean'):.1f} calls {num('episode/tool_calls/mean'):.2f} "
                          f"err {num('episode/tool_errors/mean'):.2f}")
        fields += [f"{num('throughput/tokens_per_s'):.0f} tok/s", f"{num('time/step'):.1f}s ({split})",
                   f"peak {num('memory/peak_mib'):.0f} MiB"]
        if evals:
            fields.append("eval " + " ".join(evals))
        if m.get("mismatch/kl") is not None:
            # sampler/learner mismatch: k3 KL(sampler‖learner) per token, and the share of error-token responses
            fields.append(f"mismatch kl {num('mismatch/kl'):.1e} err {num('mismatch/error_token_share'):.2f}")
        lead = 4 if m.get("episode/turns/mean") is not None else 3  # step, reward, length (, episode)
        keep = {5: len(fields), 4: lead + 3, 3: lead + 2, 2: lead + 1, 1: lead}[max(1, min(parts, 5))]
        return " | ".join(fields[:keep])

    def _fit(self, row: dict) -> str:
        """The bar's postfix: the fullest line that leaves the bar itself room on the terminal."""
        room = _columns() - 48  # tqdm's counter, percentage, rate and a short bar
        for parts in (5, 4, 3, 2, 1):
            text = self.line(row, parts).split(" | ", 1)[1]
            if len(text) <= room or parts == 1:
                return text[: max(room, 16)]
        return ""

    def close(self) -> None:
        self.file.close()
        self.progress.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


class EpisodeLog:
    """`train.log_episodes = N`: the first N samples of each step, whole, one JSON line each in
    RUN_DIR/episodes.jsonl: the prompt and the messages as the reward functions got them, the
    completion's tokens in runs of sampled / inserted (tool results, template tokens), the rewards
    (total and per function), the finish reason, the episode's counts and what reward functions
    logged with `log_extra`. On resume, the lines of steps after the checkpoint are dropped."""

    def __init__(self, run_dir: str, per_step: int, append: bool, start_step: int):
        self.path, self.per_step = os.path.join(run_dir, "episodes.jsonl"), per_step
        self.step, self.written = None, 0
        if append:
            _keep_steps_up_to(self.path, start_step)
        self.file = open(self.path, "a" if append else "w") if per_step > 0 else None

    def write(self, step: int, rows) -> None:
        """`rows()`: the samples' rows (called only when some are written this step)."""
        if self.file is None or (step == self.step and self.written >= self.per_step):
            return
        rows = rows()
        if step != self.step:
            self.step, self.written = step, 0
        for row in rows[: self.per_step - self.written]:
            self.file.write(json.dumps({"step": step, **row}, default=str) + "\n")
            self.written += 1
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def peak_mib(device) -> float:
    """Peak memory of this process: the CUDA allocator's on a GPU, the resident set's on a CPU."""
    import torch  # noqa: PLC0415  (the logger itself needs no torch)

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gathered_means(parts: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per key, the ranks' values (a rank that logged nothing under a key adds none)."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, []).append(v)
    return out


def episode_rows(sampler, tokenizer, r, total, per_fn: dict, columns: dict[str, list],
                 rows: list[dict]) -> list[dict]:
    """The samples of a round as `EpisodeLog` writes them (see metrics.EpisodeLog)."""
    completions, prompts, _ = sampler.reward_inputs(r, rows)
    out = []
    for i in range(len(r)):
        ids, mask = r.completion_ids[i].tolist(), r.sampled[i].tolist() if r.sampled is not None else None
        runs: list[dict] = []
        for j, t in enumerate(ids):
            s = True if mask is None else bool(mask[j])
            if not runs or runs[-1]["sampled"] != s:
                runs.append({"sampled": s, "ids": []})
            runs[-1]["ids"].append(t)
        tokens = [{"sampled": run["sampled"], "text": tokenizer.decode(run["ids"])} for run in runs]
        info = r.episodes[i].light() if r.episodes is not None else None
        out.append({"prompt_index": r.prompt_index[i], "prompt": prompts[i], "completion": completions[i],
                    "tokens": tokens, "reward": float(total[i]),
                    "rewards": {k: (None if math.isnan(float(v[i])) else float(v[i])) for k, v in per_fn.items()},
                    "finish_reason": r.finish_reason[i],
                    "episode": None if info is None else {k: getattr(info, k) for k in
                                                          ("turns", "tool_calls", "tool_errors", "results_cut",
                                                           "timed_out")},
                    "extra": {k: v[i] for k, v in columns.items()}})
    return out


def sum_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the sum over the ranks' dicts (a key a rank lacks counts 0): the objective's metrics
    are additive once its normalisers are global. One process: its dict."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _columns() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def _finite_or_none(v):
    """JSON has no NaN/inf: an undefined number is null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir!r} is not a run folder (it has no metrics.jsonl): pass the folder a run wrote, "
                         "the train.output_dir of its config")
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


# figure → (y-axis label, [(series key, its spread: a key of ± band, or a (low, high) pair, or None)])
PLOTS = {
    "reward": ("reward (mean ± std over the step's samples)", [("reward/mean", "reward/std")]),
    "length": ("completion tokens (mean)", [("response_length/mean", None)]),
    "kl": ("KL to the reference (per token)", [("loss/kl", None)]),
    "entropy": ("entropy (nats per token)", [("loss/entropy", None)]),
    "clip_fraction": ("share of tokens clipped", [("loss/clip_frac_low", None), ("loss/clip_frac_high", None)]),
    "mismatch": ("k3 KL(sampler ‖ learner) per token", [("mismatch/kl", None)]),
    "eval": ("held-out reward, pass@k, avg@k", [("eval/reward/mean", None)]),
    "reward_log": ("what reward functions logged (log_metric)", []),
    "episode": ("per episode (mean)", [("episode/turns/mean", None), ("episode/tool_calls/mean", None),
                                       ("episode/tool_errors/mean", None), ("episode/timeouts", None),
                                       ("episode/results_cut/mean", None)]),
}


STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"), ((0, (1, 2)), "x")]


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def plot(run_dir: str) -> list[str]:
    """PNG curves of the run's metrics (one per entry of `PLOTS`, plus one curve per reward function
    in `reward.png`); returns the files written. Each file is written under a temporary name and
    renamed, so a reader never sees half a PNG."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    except ImportError:
        raise UserError("backstream plot: needs `pip install 'backstream[plot]'` (matplotlib)") from None
    rows = read(run_dir)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    per_fn = [k for k in keys if k.startswith("reward/") and k not in ("reward/mean", "reward/std")]
    eval_k = [k for k in keys if k.startswith(("eval/pass@", "eval/avg@"))]
    out = []
    for name, (ylabel, entries) in PLOTS.items():
        logged = [k for k in keys if k.startswith("reward_log/")]
        entries = list(entries) + [(k, None) for k in {"reward": per_fn, "eval": eval_k, "reward_log": logged}.get(
            name, [])]
        drawn = [(k, band, s) for k, band in entries if (s := _series(rows, k))]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        for i, (k, band, s) in enumerate(drawn):
            xs, ys = [x for x, _ in s], [y for _, y in s]
            # series that coincide (reward/mean and avg@k, say) stay visible: a style and marker each
            style = STYLES[i % len(STYLES)]
            (line,) = ax.plot(xs, ys, label=k, linewidth=2 if band else 1.2, linestyle=style[0], marker=style[1],
                              markersize=3 if len(xs) > 1 else 5, markevery=max(1, len(xs) // 20))
            spread = dict(_series(rows, band)) if band else {}
            if spread:
                lo = [y - spread.get(x, 0.0) for x, y in s]
                hi = [y + spread.get(x, 0.0) for x, y in s]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if len(drawn) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(run_dir, f"{name}.png")
        tmp = os.path.join(run_dir, f".{name}.tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, path)
        out.append(path)
    return out


def plot_quietly(run_dir: str) -> None:
    """`plot`, where matplotlib is installed and metrics exist; a plot that fails is reported, never a
    reason to stop a run."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("matplotlib") is None or not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return
    try:
        plot(run_dir)
    except Exception as e:  # noqa: BLE001
        log.warning(f"the plots were not written ({type(e).__name__}: {e})")
