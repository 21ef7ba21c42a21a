"""What the benchmarks share: their parser, a Ray session, accuracy curves, result files, figures.

Every benchmark runs as a script of the checkout, ``python bench/NAME.py`` from the repository
root; Python then puts this folder on ``sys.path``, so ``from _common import ...`` works.
"""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Curve = list[tuple[float, float]]  # (seconds since every worker was ready, test accuracy)


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first line of a benchmark's docstring."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def add_comparison_args(p: argparse.ArgumentParser, lr: float, lr_help: str | None = None,
                        shards_help: str = "Downpour's") -> None:
    """The arguments of the digits comparisons (bench/sync.py, bench/peers.py): W workers,
    Downpour's shards and fetch/push periods, steps, batch, model, target and repeats."""
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=1, help=shards_help)
    p.add_argument("--n-fetch", type=int, default=1, help="Downpour's")
    p.add_argument("--n-push", type=int, default=1, help="Downpour's")
    p.add_argument("--steps", type=int, default=250, help="mini-batches per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=lr, help=lr_help)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--eval-every", type=float, default=0.05, help="seconds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


@contextmanager
def ray_session(num_cpus: int, object_store_memory: int | None = None) -> Iterator[None]:
    """An embedded Ray session with ``num_cpus`` logical CPUs, shut down on the way out."""
    import ray

    from distbelief import cluster

    cluster.connect(num_cpus=num_cpus, object_store_memory=object_store_memory)
    try:
        yield
    finally:
        ray.shutdown()


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds the processes ``pids`` have used so far (from ``/proc``)."""
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accuracy(model, x, y) -> float:
    """Test accuracy of ``model`` on ``x`` ``(N, features)`` with labels ``y`` ``(N,)``."""
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def time_to(curve: Curve, target: float) -> float | None:
    """First elapsed time at which accuracy reached ``target`` (None if it never did)."""
    return next((t for t, acc in curve if acc >= target), None)


def fmt(t: float | None) -> str:
    return "   never" if t is None else f"{t:7.2f}s"


def downpour_curve(events: list[dict]) -> Curve:
    """(seconds since every actor was up, test accuracy) of a Downpour run's eval events."""
    start = next(e["t"] for e in events if e["event"] == "placement")
    return [(e["t"] - start, e["test_accuracy"]) for e in events
            if e["event"] == "eval" and e["t"] >= start]


def write_results(out: str | Path, name: str, results: dict[str, Any]) -> Path:
    """Write ``results`` as ``OUT/NAME`` (JSON, indent 1), creating ``OUT``; the file's path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    return path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out: str | Path) -> Path:
    """Lay out ``fig``, write it as a PNG to ``out`` (creating its folder), close it."""
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
