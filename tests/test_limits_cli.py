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


@pytest.mark.parametrize("case", CASES)
def test_a_resource_limit_is_one_line_and_exit_code_2(tmp_path, case):
    words, message = CASES[case]
    (tmp_path / "huge.py").write_text(HUGE)
    (tmp_path / "afile").write_text("not a folder")
    proc = cli(tmp_path, *words)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distbelief: error: "), proc.stderr
    assert message in lines[0]
    assert not (tmp_path / "run").exists()  # nothing half-written
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_more_replicas_than_cores_is_a_warning_and_a_working_run(tmp_path):
    proc = cli(tmp_path, "--replicas", "3", "--shards", "1", "--steps", "20", "--num-cpus", "4",
               "--run-dir", "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the machine this runs on may have more cores; the warning shows only past them
    if len(os.sched_getaffinity(0)) < 3:
        assert "warning: --replicas 3 x --partitions 1 = 3 processes share" in proc.stderr
