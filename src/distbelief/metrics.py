"""Run folder: config, metrics as JSONL (one event per line), and the loss/accuracy plot."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


class RunLog:
    """Appends JSON events (each with wall-clock ``t`` in seconds) to ``metrics.jsonl``.

    With ``run_dir=None`` events are kept in memory only.
    """

    def __init__(self, run_dir: str | Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.start = time.time()
        self.events: list[dict] = []
        self._fh = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # line-buffered: a killed driver leaves every event it logged, whole lines only
            self._fh = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8", buffering=1)

    def log(self, event: str, **fields) -> dict:
        record = {"event": event, "t": fields.pop("t", time.time())} | fields
        self.events.append(record)
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")
        return record

    def write_json(self, name: str, obj: dict) -> None:
        if self.run_dir is not None:
            (self.run_dir / name).write_text(json.dumps(obj, indent=2) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(run_dir: str | Path) -> list[dict]:
    """All events of a run folder's ``metrics.jsonl``."""
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


STEP_TIMES = ("compute_s", "fetch_wait_s", "push_wait_s", "idle_s")  # a step's breakdown


def time_shares(steps: list[dict]) -> dict[int, dict[str, float]]:
    """Per replica, the share of its step time (summed over its step events that carry a
    breakdown) spent in each of :data:`STEP_TIMES`; shares sum to 1."""
    totals: dict[int, dict[str, float]] = {}
    for e in steps:
        if all(k in e for k in STEP_TIMES):
            row = totals.setdefault(e["replica"], dict.fromkeys(STEP_TIMES, 0.0))
            for k in STEP_TIMES:
                row[k] += e[k]
    return {r: {k: v / (sum(row.values()) or 1.0) for k, v in row.items()}
            for r, row in sorted(totals.items())}


def running_mean(t: np.ndarray, values: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``values`` ordered by time ``t``, and their running mean over a window of a 50th of
    them (at least 1): ``(t, values, t at each window's end, the window's mean)``."""
    order = np.argsort(t, kind="stable")
    t, values = t[order], values[order]
    window = max(1, len(values) // 50)
    return t, values, t[window - 1:], np.convolve(values, np.ones(window) / window, "valid")


def plot_grad_norms(ax, steps: list[dict], start: float, clip: float) -> None:
    """On a second axis of the loss panel: the running mean of the replicas' gradient norms
    before clipping (``--clip-grad-norm``), and the bar as a dotted line."""
    finite = [e for e in steps if np.isfinite(e["grad_norm"])]
    if not finite:
        return
    _, _, tm, mean = running_mean(np.array([e["t"] - start for e in finite]),
                                  np.array([e["grad_norm"] for e in finite]))
    ax.plot(tm, mean, color="tab:red", lw=1, label="gradient norm")
    if clip:
        ax.axhline(clip, color="tab:red", ls=":", lw=1, label=f"--clip-grad-norm {clip:g}")
    ax.set_ylabel("gradient norm before clipping", color="tab:red")
    ax.legend(loc="center right", fontsize="small")


def plot_breakdown(ax, steps: list[dict]) -> None:
    """Stacked bars: where each replica's step time went (compute, fetch/push wait, idle)."""
    shares = time_shares(steps)
    replicas = list(shares)
    bottom = np.zeros(len(replicas))
    for k in STEP_TIMES:
        vals = np.array([shares[r][k] for r in replicas])
        ax.bar([str(r) for r in replicas], vals, bottom=bottom, label=k[:-2].replace("_", " "))
        bottom += vals
    if replicas:
        ax.legend(fontsize="small")
    ax.set(xlabel="replica", ylabel="share of step time", title="Where replica time goes",
           ylim=(0, 1))


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Plot training loss and test accuracy against wall time (a dashed line where the run
    was scaled), with the gradient norms where steps recorded them (``--clip-grad-norm``),
    and each replica's step-time breakdown (one bar per replica that ran, added or stopped
    ones included); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_events(run_dir)
    start = min(e["t"] for e in events)
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    fig, (ax_loss, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(16, 4))
    plot_breakdown(ax_time, steps)
    if steps:
        t, loss, tm, smooth = running_mean(np.array([e["t"] - start for e in steps]),
                                           np.array([e["loss"] for e in steps]))
        ax_loss.plot(t, loss, ".", ms=2, alpha=0.25, label="replica steps")
        ax_loss.plot(tm, smooth, label=f"mean of {len(t) - len(tm) + 1}")
        ax_loss.set_yscale("log")
        ax_loss.legend()
    normed = [e for e in steps if "grad_norm" in e]
    if normed:
        config = Path(run_dir) / "config.json"
        clip = json.loads(config.read_text()).get("clip_grad_norm", 0) if config.exists() else 0
        plot_grad_norms(ax_loss.twinx(), normed, start, clip)
    ax_loss.set(xlabel="wall time (s)", ylabel="training loss", title="Loss")
    metric = "test_auc" if any("test_auc" in e for e in evals) else "test_accuracy"
    scored = [e for e in evals if metric in e]  # click models report AUC, classifiers accuracy
    if scored:
        ax_acc.plot([e["t"] - start for e in scored], [e[metric] for e in scored], "o-")
    label = "test AUC" if metric == "test_auc" else "test accuracy"
    ax_acc.set(xlabel="wall time (s)", ylabel=label, title=f"Held-out {label[5:]}",
               ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        for e in events:  # replicas added or stopped while the run went on
            if e["event"] == "scale":
                ax.axvline(e["t"] - start, ls="--", color="grey", lw=1)
                ax.annotate(f"{e['to']} replicas", (e["t"] - start, 0.98), rotation=90,
                            xycoords=("data", "axes fraction"), va="top", fontsize="small")
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "plot.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
