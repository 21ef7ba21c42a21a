"""The command line: bad input gives one line, exit code 2, and starts nothing."""

import subprocess
import sys

import pytest
import ray

from distbelief.cli import main

BAD = [
    (["--replicas", "0"], "--replicas must be an integer >= 1"),
    (["--shards", "0"], "--shards must be an integer >= 1"),
    (["--n-fetch", "0"], "--n-fetch must be an integer >= 1"),
    (["--n-push", "-3"], "--n-push must be an integer >= 1"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--optimizer", "rmsprop"], "--optimizer 'rmsprop' is unknown: choose one of sgd"),
    (["--dataset", "mnist"], "--dataset 'mnist' is unknown: choose one of digits"),
    (["--algorithm", "hogwild"], "--algorithm 'hogwild' is unknown"),
    (["--shards", "100000"], "--shards 100000 exceeds the model's 4810 parameter elements"),
    (["--address", "127.0.0.1:1"], "cannot reach a Ray cluster at 127.0.0.1:1"),
    (["--address", "nonsense"], "--address 'nonsense' is not HOST:PORT"),
    (["--replicas", "two"], "argument --replicas: invalid int value: 'two'"),
    (["--warmstart-steps", "500", "--steps", "100"], "--warmstart-steps (500) exceeds --steps"),
    (["--slow-replica", "7:2", "--replicas", "2"], "--slow-replica 7:2.0 names replica 7"),
    (["--slow-replica", "x"], "is not INDEX:FACTOR"),
]


def run_cli(argv: list[str]) -> int:
    """main()'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(argv, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = run_cli(["train", "--run-dir", str(run_dir), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("distbelief: error: ") and message in lines[0]
    assert "Traceback" not in err
    assert not ray.is_initialized()
    assert not run_dir.exists()


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distbelief.cli", "train", "--lr", "0",
                           "--run-dir", str(tmp_path / "r")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("distbelief: error: --lr must be a finite number > 0 "
                                   "(got 0.0)")
    assert proc.stdout == ""
