"""The command line: bad input gives one line, exit code 2, and starts nothing."""

import subprocess
import sys

import numpy as np
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
    (["--model", "lc", "--partitions", "9"], "grid (9, 1) has more blocks than layer"),
    (["--partitions", "4"], "cannot cut 3 layers into 4 stages"),
    (["--partition-by", "diagonal"], "--partition-by 'diagonal' is unknown"),
    (["--model", "lc", "--channels", "0"], "--channels must be an integer >= 1"),
    (["--grad-dtype", "int8"], "--grad-dtype 'int8' is unknown: choose one of float32"),
    (["--data-split", "random"], "--data-split 'random' is unknown: choose one of epoch, fixed"),
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


def bad_npz(tmp_path, **arrays):
    rng = np.random.default_rng(0)
    good = {"x_train": rng.random((20, 4), dtype=np.float32), "y_train": np.arange(20) % 3,
            "x_test": rng.random((6, 4), dtype=np.float32), "y_test": np.arange(6) % 3}
    good.update(arrays)
    path = tmp_path / "data.npz"
    np.savez(path, **{k: v for k, v in good.items() if v is not None})
    return path


NPZ_CASES = [
    ({"y_test": None}, "lacks y_test"),
    ({"x_train": np.ones((20, 4), np.int64)}, "x_train must be a 2-D float array"),
    ({"y_train": np.zeros(20, np.float32)}, "y_train must be a 1-D integer array"),
    ({"y_train": np.zeros(19, np.int64)}, "x_train has 20 rows but y_train 19"),
    ({"x_test": np.full((6, 4), np.nan, np.float32)}, "x_test contains NaN or inf"),
    ({"x_test": np.ones((6, 5), np.float32)}, "different column counts"),
]


@pytest.mark.parametrize("arrays,message", NPZ_CASES, ids=[m for _, m in NPZ_CASES])
def test_malformed_npz_dataset_is_one_line_exit_2(tmp_path, capsys, arrays, message):
    path = bad_npz(tmp_path, **arrays)
    code = run_cli(["train", "--dataset", str(path), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not ray.is_initialized() and not (tmp_path / "r").exists()


def test_missing_and_non_npz_files(tmp_path, capsys):
    assert run_cli(["train", "--dataset", str(tmp_path / "nope.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    assert run_cli(["train", "--dataset", str(junk), "--run-dir", str(tmp_path / "r")]) == 2
    assert "is not a readable .npz" in capsys.readouterr().err


def test_npz_with_pickled_objects_is_refused_without_running_code(tmp_path, capsys):
    path = tmp_path / "evil.npz"
    np.savez(path, x_train=np.array([{"a": 1}], dtype=object), y_train=np.zeros(1, np.int64),
             x_test=np.zeros((1, 1), np.float32), y_test=np.zeros(1, np.int64))
    assert run_cli(["train", "--dataset", str(path), "--run-dir", str(tmp_path / "r")]) == 2
    assert "is not a readable .npz" in capsys.readouterr().err


def test_train_on_a_users_npz(tmp_path, capsys):
    from distbelief import data

    ds = data.digits()
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
    code = run_cli(["train", "--dataset", str(path), "--replicas", "2", "--steps", "200",
                    "--no-progress", "--run-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0
    assert float(out.strip().splitlines()[-1].split()[1].split("=")[1]) > 0.9


def test_bench_runs_a_bench_script_and_refuses_unknown_names(capsys):
    assert run_cli(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no benchmark 'no-such-bench'" in err[0] and "ps" in err[0]
    assert run_cli(["bench", "ps", "--help"]) == 0
    assert "Push+apply and fetch throughput" in capsys.readouterr().out
