"""Every resource limit is an input error through the real CLI process: one line, exit code
2, nothing started and nothing written."""

import os
import subprocess
import sys

import pytest

HUGE = '''
from torch import nn


def build():  # 100,650,110,010 parameters: counted on the meta device, never allocated
    return nn.Sequential(nn.Linear(64, 10**7), nn.Linear(10**7, 10**4), nn.Linear(10**4, 10))
'''


def cli(tmp_path, *words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distbelief.cli", "train", "--no-progress",
                           *words], cwd=tmp_path, capture_output=True, text=True, timeout=120)


CASES = {
    "model": (["--model", "./huge.py:build", "--run-dir", "run"],
              "the model's 100,650,110,010 parameters need"),
    "samples": (["--dataset", "synthetic", "--samples", str(10**12), "--run-dir", "run"],
                "--samples 1,000,000,000,000 of 32 features need"),
    "replicas": (["--replicas", "1000", "--run-dir", "run"],
                 "--replicas 1000 x --partitions 1 = 1000 processes on"),
    "run_dir": (["--run-dir", "afile"], "--run-dir afile is a file: give the path of a folder"),
    "run_dir_parent": (["--run-dir", "afile/run"], "--run-dir afile/run cannot be created"),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every case's real CLI process, all started at once (each spends its few seconds
    importing torch on one core), each in a folder of its own: case -> (process, folder)."""
    started = {}
    for case, (words, _) in CASES.items():
        folder = tmp_path_factory.mktemp(case)
        (folder / "huge.py").write_text(HUGE)
        (folder / "afile").write_text("not a folder")
        started[case] = (subprocess.Popen(
            [sys.executable, "-m", "distbelief.cli", "train", "--no-progress", *words],
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), folder)
    done = {}
    for case, (proc, folder) in started.items():
        _, err = proc.communicate(timeout=120)
        done[case] = (proc.returncode, err, folder)
    return done


@pytest.mark.parametrize("case", CASES)
def test_a_resource_limit_is_one_line_and_exit_code_2(refused, case):
    code, err, folder = refused[case]
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distbelief: error: "), err
    assert CASES[case][1] in lines[0]
    assert not (folder / "run").exists()  # nothing half-written
    assert (folder / "afile").read_text() == "not a folder"


def test_more_replicas_than_cores_is_a_warning_and_a_working_run(tmp_path):
    proc = cli(tmp_path, "--replicas", "3", "--shards", "1", "--steps", "20", "--num-cpus", "4",
               "--run-dir", "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the machine this runs on may have more cores; the warning shows only past them
    if len(os.sched_getaffinity(0)) < 3:
        assert "warning: --replicas 3 x --partitions 1 = 3 processes share" in proc.stderr
