"""A Figure-4 style plot (test accuracy vs wall time, one line per method) from bench results.

Run: .venv/bin/python bench/figure4.py runs/bench-sync/sync.json runs/bench-peers/peers.json
     [--out runs/figure4.png] [--target 0.95]
``bench/sync.py`` and ``bench/peers.py`` call :func:`plot` on their own curves; this script
draws the curves of several result files in one figure.
"""

from __future__ import annotations

import json
from pathlib import Path

from _common import parser as make_parser
from _common import pyplot, save_figure


def plot(curves: dict[str, list], out: str | Path, target: float | None = None) -> Path:
    """Draw ``{method: [(seconds, test accuracy), ...]}`` as one line each; the PNG's path."""
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for name, curve in curves.items():
        t, acc = zip(*curve) if curve else ((), ())
        ax.plot(t, acc, "--" if "slow" in name else "-", marker=".", ms=3, label=name)
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.0%}")
    ax.set(xlabel="wall time since all workers were ready (s)", ylabel="test accuracy",
           title="Digits MLP: test accuracy vs wall time", ylim=(0.5, 1.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("results", nargs="+", help="sync.json / peers.json files")
    parser.add_argument("--out", default="runs/figure4.png")
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args()
    curves: dict[str, list] = {}
    for path in args.results:
        for name, curve in json.loads(Path(path).read_text())["curves"].items():
            curves[name if name not in curves else f"{name} ({Path(path).stem})"] = curve
    print(plot(curves, args.out, args.target))


if __name__ == "__main__":
    main()
