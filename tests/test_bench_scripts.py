"""Every benchmark runs as a script of the checkout: ``python bench/NAME.py --help``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One interpreter runs every script's --help as `python bench/NAME.py --help` would (the
# script's folder first on sys.path, run as __main__), so torch and Ray are imported once.
RUN_ALL = """
import contextlib, io, json, runpy, sys
from pathlib import Path

bench = Path("bench").resolve()
sys.path.insert(0, str(bench))
report = {}
for path in sorted(bench.glob("[!_]*.py")):
    sys.argv, out = [str(path), "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
        code = "returned without exiting"
    except SystemExit as exit:
        code = exit.code
    report[path.name] = [code, out.getvalue().startswith("usage: ")]
print(json.dumps(report))
"""


def test_every_bench_script_prints_its_help():
    names = sorted(p.name for p in (ROOT / "bench").glob("[!_]*.py"))
    done = subprocess.run([sys.executable, "-c", RUN_ALL], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {name: [0, True] for name in names}


def test_an_unknown_workloads_method_is_refused_before_anything_runs():
    done = subprocess.run([sys.executable, "bench/workloads.py", "--methods", "downpour",
                           "indepndent"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1].startswith(
        "workloads.py: error: --methods indepndent: not a method; choose from floor single-1t")


def test_a_bad_optimizer_argument_to_the_staleness_study_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "bench/staleness.py", "--optimizer", "adam",
                           "--optimizer-arg", "nope=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1].startswith(
        "staleness.py: error: --optimizer-arg nope: torch.optim.Adam (--optimizer adam) takes "
        "no 'nope'")


def test_a_compiled_graph_bench_with_no_shards_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "bench/compiled.py", "--shards", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == "compiled.py: error: --shards must be at least 1 (got 0)"


def test_a_layout_bench_with_no_steps_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "bench/layout.py", "--steps", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "layout.py: error: --threads, --batch-size, --steps and --rounds must be at least 1")
