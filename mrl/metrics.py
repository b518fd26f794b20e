"""What a run shows: a rich progress bar (a plain line every ``PLAIN_EVERY`` steps when the console is not
a terminal: logs, CI, Slurm), metrics.jsonl, a PNG of the curves, a one-screen summary at the end, and the
experiment trackers of ``logger`` (TensorBoard by default, W&B, MLflow: ``mrl.loggers``), which get the
config, every scalar at its step and the curves. Controller (rank 0) only.

The progress line shows ``-`` for a figure with no value this step (a mismatch category without tokens,
routing diagnostics not computed) and which side bounds the run (``bound_by``)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mrl._compat.te import trainer_spec
from mrl.log import get_logger

log = get_logger(__name__)

MISMATCH_KL = ("mismatch/numerics_kl", "mismatch/routing_kl", "mismatch/stale_kl")
"""The engine-vs-trainer KL by cause (``mrl.megatron.mismatch``; docs/keep_routing.md)."""
CURVES = [("reward", "train reward (sampled)"),
          ("routing_disagreement", "routing disagreement, replay off"), ("kl_engine_replay_on", "KL engine->train"),
          (MISMATCH_KL, "KL engine->train by cause"), ("sync_seconds", "weight sync [s]"), ("step_seconds", "step [s]")]
"""(key or keys, title) per panel of curves.png; a panel of several keys draws one line each. Each evaluation
set gets a panel of its own after the first (``eval_panels``)."""
EVAL_KEY = re.compile(r"eval/([^/]+)/(greedy_pass_at_1|pass_at_(\d+))")
"""An evaluation set's pass rates (``mrl.rollout.evaluation.EvalResult.row``)."""
SYMLOG_FLOOR = 1e-15
"""Panels of several keys use a symmetric log scale, linear below this: KLs span decades (fp32 numerics
near 1e-13 next to staleness near 1e-3), and the routing part (a difference) may be slightly negative."""
PLAIN_EVERY = 10
"""Steps between progress lines when the console is not a terminal (a live bar only renders on one)."""
BOUND_STEPS = 10
"""Recent steps that ``bound_by`` judges by."""
ENGINE_BOUND_WAIT = {"overlap": 0.05, "sync": 0.5}
"""Share of the recent steps' time spent waiting for samples from which the engines bound the run, by
``train.mode`` (``bound_by``)."""


def shown(value: float | None, spec: str) -> str:
    """``value`` in format ``spec``; ``-`` for none (a missing figure, or NaN: no tokens to average over)."""
    return "-" if value is None or math.isnan(value) else format(value, spec)


def bound_by(rows: list[dict], mode: str = "overlap") -> str | None:
    """Which side sets the pace, from the last ``BOUND_STEPS`` steps' phases: ``engine-bound`` when the
    trainer spent at least ``ENGINE_BOUND_WAIT[mode]`` of their time waiting for samples
    (``wait_seconds / step_seconds``, both summed over the steps), else ``trainer-bound``; None before a step.

    In overlap mode the engines generate while the trainer computes: when they keep up, a batch is ready
    in the buffer and taking it costs only its delivery (a few percent of a step at most), so a longer
    wait means the trainer idles for the engines, and making the trainer faster would only lengthen the
    wait. In sync mode generation and training take turns, and the side that takes the larger part of
    the step bounds it."""
    recent = [r for r in rows if "step_seconds" in r and "wait_seconds" in r][-BOUND_STEPS:]
    step = sum(r["step_seconds"] for r in recent)
    if not recent or step <= 0:
        return None
    wait = sum(r["wait_seconds"] for r in recent)
    return "engine-bound" if wait / step >= ENGINE_BOUND_WAIT[mode] else "trainer-bound"


def eval_panels(rows: list[dict]) -> list[tuple[tuple[str, ...], str]]:
    """One panel per evaluation set in ``rows``: its greedy pass@1, then pass@k by k."""
    sets: dict[str, set[str]] = {}
    for r in rows:
        for k in r:
            if m := EVAL_KEY.fullmatch(k):
                sets.setdefault(m.group(1), set()).add(k)

    def order(key: str) -> int:
        m = EVAL_KEY.fullmatch(key)
        return 0 if m.group(3) is None else int(m.group(3))

    return [(tuple(sorted(keys, key=order)), f"eval {name} (x: step measured)") for name, keys in sets.items()]


def eval_line(result, step_now: int | None = None) -> str:
    """The console's line for an evaluation result (``mrl.rollout.evaluation.EvalResult``)."""
    v = f"v{result.version}" + (f"-{result.version_max}" if result.version_max != result.version else "")
    rates = "  ".join(f"{k.replace('_pass_at_', ' pass@').replace('pass_at_', 'pass@')} {x:.3f}"
                      for k, x in result.metrics.items())
    notes = [f"{result.prompts} prompts", f"{result.seconds:.1f} s"]
    if result.version_max != result.version:
        notes.append(f"{result.mixed:.0%} of completions span a weight sync")
    if result.failed:
        notes.append(f"{result.failed} completions failed")
    if step_now is not None and step_now != result.step:
        notes.append(f"arrived at step {step_now}")
    return f"eval {result.name} step {result.step} ({v}): {rates}  ({', '.join(notes)})"


def tracker_key(key: str) -> str:
    """The trackers' name of a step metric of ``metrics.jsonl``: ``train/<key>`` unless it has a section."""
    return key if "/" in key else f"train/{key}"


class MetricsLog:
    def __init__(self, run_dir: str, total: int, history: list[dict] | None = None, cfg=None):
        """``cfg``: the run's config, for its trackers (``logger``, ``tracking``); without, TensorBoard only.
        A ``history`` (a resumed run's) continues the tracker runs it was logged to."""
        from mrl.loggers import TensorBoardLogger, config_dict, make_loggers

        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.loggers = make_loggers(cfg, resuming=bool(history)) if cfg is not None else [TensorBoardLogger(run_dir)]
        if cfg is not None:
            config = config_dict(cfg)
            for lg in self.loggers:
                lg.log_config(config)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.history: list[dict] = list(history or [])
        self.console = Console(stderr=True)
        self._bar = Progress(TextColumn("[bold]mrl train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=self.console, transient=False)
        done = max((r["step"] for r in self.history), default=0)
        self.task = self._bar.add_task("", total=total, completed=done)
        self.total = total
        self.mode = cfg.train.mode.value if cfg is not None else "overlap"
        self.plain = not self.console.is_terminal
        if not self.plain:
            self._bar.start()

    def scalar(self, key: str, value: float, step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(step, {key: value})
        self._record({"step": step, key: value})

    def evaluation(self, result, row: dict[str, float], step_now: int | None = None) -> None:
        """An evaluation's ``row`` (``eval/<set>/...``) at the step it measured, to the trackers and
        metrics.jsonl, and its line on the console."""
        for lg in self.loggers:
            lg.log_metrics(result.step, row)
        self._record({"step": result.step, **row})
        line = eval_line(result, step_now)
        if self.plain:
            log.info("%s", line)
        else:
            self.console.print(f"[mrl] {line}", highlight=False)

    def progress(self, text: str, step: int | None = None, total: int | None = None) -> None:
        """The bar's text; without a terminal a line, every ``PLAIN_EVERY`` steps of ``total`` if given."""
        self._bar.update(self.task, description=text)
        if self.plain and (step is None or step % PLAIN_EVERY == 0 or step == total):
            log.info("%s", text)

    def step(self, step: int, metrics: dict[str, float], staleness: Counter | None = None,
             extra: dict | None = None) -> None:
        """``extra``: non-scalar fields for ``metrics.jsonl`` only (e.g. requests served per engine)."""
        named = {tracker_key(k): v for k, v in metrics.items()}
        for lg in self.loggers:
            lg.log_metrics(step, named)
        if staleness:
            samples = [lag for lag, n in staleness.items() for _ in range(n)]
            import numpy as np

            for lg in self.loggers:
                lg.log_histogram("rollout/staleness", np.asarray(samples), step)
            metrics = metrics | {"staleness_hist": dict(sorted(staleness.items()))}
        self._record({"step": step, **metrics, **(extra or {})})
        desc = (f"reward {metrics.get('reward', 0):.2f}  "
                f"dis {shown(metrics.get('routing_disagreement'), '.3f')}  "
                "kl num/rt/stale " + "/".join(shown(metrics.get(k), ".1e") for k in MISMATCH_KL) + "  "
                f"sync {metrics.get('sync_seconds', 0):.2f}s  v{int(metrics.get('version', 0))}")
        if bound := bound_by(self.history, self.mode):
            desc += f"  {bound}"
        self._bar.update(self.task, completed=step, description=desc)
        if self.plain and (step % PLAIN_EVERY == 0 or step == self.total):
            log.info("step %d/%d  %s  step %.2fs", step, self.total, desc, metrics.get("step_seconds", 0))

    def _record(self, row: dict) -> None:
        self.history.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.history if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def close(self, cfg) -> None:
        if not self.plain:
            self._bar.stop()
        self.jsonl.close()
        curves = os.path.join(self.run_dir, "curves.png")
        plotted = self.plot(curves)
        for lg in self.loggers:
            if plotted:
                lg.log_image("curves", curves)
            lg.close()
        self.summary(cfg)

    def plot(self, path: str) -> bool:
        """The curves of ``CURVES`` that have points, as a PNG at ``path``; False when none has any."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        present = [(keys, t, not isinstance(keys, str)) for keys, t in CURVES
                   if any(self.series(k)[0] for k in ((keys,) if isinstance(keys, str) else keys))]
        present[1:1] = [(keys, t, False) for keys, t in eval_panels(self.history)]  # after the train reward
        if not present:
            return False
        cols = min(3, len(present))
        rows = (len(present) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax in axes.flat[len(present):]:
            ax.set_visible(False)
        for ax, (keys, title, symlog) in zip(axes.flat, present):
            many = not isinstance(keys, str)
            for k in (keys if many else (keys,)):
                xs, ys = self.series(k)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=k.split("/")[-1] if many else None)
            if symlog:
                ax.set_yscale("symlog", linthresh=SYMLOG_FLOOR)
            if many:
                ax.legend(fontsize=7)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True

    def summary(self, cfg) -> dict:
        def first_last_median(key):
            _, ys = self.series(key)
            if not ys:
                return float("nan"), float("nan"), float("nan")
            return ys[0], ys[-1], statistics.median(ys)

        evals = [k for keys, _ in eval_panels(self.history) for k in keys]
        rows = {k: first_last_median(k) for k in ("reward", "success", "eval/accuracy", *evals, "routing_disagreement",
                                                  "kl_engine_replay_on", "kl_engine_replay_off", *MISMATCH_KL,
                                                  "mismatch/stale_is_cut_frac", "sync_seconds", "step_seconds")}
        table = Table(title=f"mrl train: {cfg.data.task} / {cfg.algo.loss.value} / {cfg.train.mode.value}")
        for c in ("metric", "first", "last", "median"):
            table.add_column(c)
        for k, (a, b, med) in rows.items():
            table.add_row(k, *(shown(v, ".4g") for v in (a, b, med)))
        self.console.print(table)
        out = {k: {"first": a, "last": b, "median": med} for k, (a, b, med) in rows.items()}
        out["run"] = {"trainer_spec": trainer_spec(), "dtype": cfg.model.dtype.value, "model": cfg.model.hf_path,
                      "parallel": {k: getattr(cfg.parallel, k) for k in ("tp", "pp", "ep", "etp", "cp")}}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(out, f, indent=1)
        return out
