"""The command line: bad input gives one line, exit code 2, and starts nothing."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from distbelief.cli import build_parser, config_values, main
from distbelief.config import FIELDS, SECTIONS, TrainConfig, field_type, flag
from distbelief.config_file import to_toml

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    (["--replicas", "0"], "--replicas must be an integer >= 1"),
    (["--shards", "0"], "--shards must be an integer >= 1"),
    (["--n-fetch", "0"], "--n-fetch must be an integer >= 1"),
    (["--n-push", "-3"], "--n-push must be an integer >= 1"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--optimizer", "adamm"], "--optimizer 'adamm' is unknown: choose one of sgd"),
    (["--optimizer", "LBFGS"], "LBFGS needs a closure re-evaluating the whole model"),
    (["--optimizer", "adam", "--optimizer-arg", "momentum=0.9"],
     "--optimizer-arg momentum: torch.optim.Adam (--optimizer adam) takes no 'momentum'"),
    (["--optimizer", "adam", "--optimizer-arg", "betas=0.9"],
     "--optimizer-arg betas=0.9: pass 2 comma-separated numbers"),
    (["--optimizer", "adam", "--optimizer-arg", "eps=-1"], "torch.optim.Adam rejects eps=-1.0"),
    (["--optimizer-arg", "weight_decay"], "'weight_decay' is not KEY=VALUE"),
    (["--optimizer", "sgd", "--lr", "-0.01"], "--lr must be a finite number > 0"),
    (["--lr-schedule", "cosine"], "--lr-schedule 'cosine': phase 'cosine': write cosine:T"),
    (["--lr-schedule", "cosine:100,warmup:10"], "the warm-up must come first"),
    (["--lr-schedule", "step:100:2"], "GAMMA must be in (0, 1]"),
    (["--lr-schedule", "linear:5"], "unknown phase 'linear'"),
    (["--optimizer", "adam", "--partitions", "2"],
     "--optimizer adam cannot update row-sparse tables or model-parallel ranges"),
    (["--optimizer", "adam", "--dataset", "ctr"],
     "--optimizer adam cannot update row-sparse tables or model-parallel ranges"),
    (["--dataset", "imagenet"], "--dataset 'imagenet' is unknown: choose one of digits"),
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
    (["--average", "ema:1.5"], "--average 'ema:1.5' is not understood: pass ema:DECAY"),
    (["--average", "polyak", "--algorithm", "sandblaster"],
     "--average averages Downpour's dense shards only, not sandblaster"),
    (["--max-staleness", "-1"], "--max-staleness must be an integer >= 0 (got -1)"),
    (["--delay-compensation", "-0.5"], "--delay-compensation must be a finite number >= 0"),
    (["--delay-compensation", "inf"], "--delay-compensation must be a finite number >= 0"),
    (["--staleness-lr", "--algorithm", "sandblaster"],
     "--staleness-lr applies to --algorithm downpour only, not sandblaster"),
    (["--delay-compensation", "0.1", "--partitions", "2"],
     "--delay-compensation works on dense pushes only"),
    (["--delay-compensation", "0.1", "--shard-backups", "1"],
     "--shard-backups with --delay-compensation: standbys apply pushes without"),
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


@pytest.mark.parametrize("name,value,message", [
    ("DISTBELIEF_INLINE_BYTES", "1MB", "DISTBELIEF_INLINE_BYTES='1MB' is not a byte count: set "
     "it to a whole number of bytes (Ray's own default is 102400) or unset it"),
    ("DISTBELIEF_TASK_EVENTS", "yes", "DISTBELIEF_TASK_EVENTS='yes': set it to 1 (Ray's task "
     "events on, as in Ray's tools) or 0, or unset it"),
])
def test_a_bad_switch_in_the_environment_is_one_line_and_exit_2(tmp_path, name, value, message):
    """Read where the run connects, not when the package is imported (a traceback then),
    and before the run folder is made."""
    env = dict(os.environ, **{name: value})
    proc = subprocess.run([sys.executable, "-m", "distbelief.cli", "train", "--steps", "5",
                           "--run-dir", str(tmp_path / "r")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"distbelief: error: {message}"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


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


def test_benchmarks_run_as_scripts_of_the_checkout_and_bench_is_refused(capsys):
    assert run_cli(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python bench/NAME.py" in err[0] and "ps" in err[0]
    assert run_cli(["bench", "ps", "--help"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    proc = subprocess.run([sys.executable, "bench/ps.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Push+apply and fetch throughput" in proc.stdout


def train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def sample(name: str) -> tuple[list[str], object]:
    """Command-line words that set field ``name`` to a non-default value, and that value."""
    f, kind = FIELDS[name], field_type(name)
    if kind is bool:
        return [flag(name)], not f.default
    if kind is dict and f.metadata.get("sep") == "=":  # --optimizer-arg KEY=VALUE
        return [flag(name), "betas=0.9,0.99", flag(name), "eps=1e-6"], {"betas": "0.9,0.99",
                                                                       "eps": "1e-6"}
    if kind is dict:
        return [flag(name), "1:3", flag(name), "0:2.5"], {1: 3.0, 0: 2.5}
    if kind is list:
        return [flag(name), "a=1", flag(name), "b=x"], ["a=1", "b=x"]
    value = {int: 7, float: 0.25, str: "x"}[kind]
    if "choices" in f.metadata:
        value = f.metadata["choices"][-1]
    return [flag(name), str(value)], value


def test_generated_parser_reaches_every_field_with_the_dataclass_defaults():
    parser = build_parser()
    assert TrainConfig(**config_values(parser.parse_args(["train"]))) == TrainConfig()
    for name in FIELDS:
        words, value = sample(name)
        assert config_values(parser.parse_args(["train", *words])) == {name: value}, name
    args = parser.parse_args(["train", *(w for name in FIELDS for w in sample(name)[0])])
    assert config_values(args) == {name: sample(name)[1] for name in FIELDS}


def test_help_groups_flags_by_section_with_each_fields_help(capsys):
    actions = {a.dest: a for a in train_parser()._actions}
    for name, f in FIELDS.items():
        assert actions[name].help.startswith(f.metadata["help"].replace("%", "%%")), name
        assert flag(name) in actions[name].option_strings
    groups = {g.title: {a.dest for a in g._group_actions} for g in train_parser()._action_groups}
    for section in SECTIONS:
        assert {n for n, f in FIELDS.items() if f.metadata["section"] == section} <= groups[
            section]
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--config FILE.toml" in out and "--eval-every SECONDS" in out
    assert "mini-batches per replica (default 300; ctr 450)" in out


def test_config_file_sets_sections_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[downpour]\nn_fetch = 2\nlr = 0.1\n[parallelism]\nreplicas = 3\n'
                    'slow_replicas = { 0 = 4.0 }\n[run]\nseed = 5\n')
    args = build_parser().parse_args(["train", "--config", str(path), "--lr", "0.2",
                                      "--slow-replica", "1:2", "--seed", "0"])
    cfg = TrainConfig(**config_values(args))
    assert (cfg.n_fetch, cfg.lr, cfg.replicas, cfg.slow_replicas, cfg.seed) == (
        2, 0.2, 3, {1: 2.0}, 0)
    assert cfg.steps is None and cfg.validate().steps == 300


def test_a_run_config_toml_is_reusable_with_config(tmp_path):
    cfg = TrainConfig(replicas=3, n_fetch=2, slow_replicas={2: 1.5}).validate(command_line=True)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    args = build_parser().parse_args(["train", "--config", str(path)])
    assert TrainConfig(**config_values(args)).validate(command_line=True) == cfg


def test_optimizer_args_and_schedule_from_a_config_file_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[downpour]\noptimizer = "adam"\nlr_schedule = "warmup:10,cosine:100"\n'
                    'optimizer_args = { betas = [0.8, 0.9], amsgrad = true }\n')
    args = build_parser().parse_args(["train", "--config", str(path),
                                      "--optimizer-arg", "weight_decay=0.01"])
    cfg = TrainConfig(**config_values(args)).validate(command_line=True)
    assert cfg.optimizer_args == {"weight_decay": "0.01"}  # the flag replaces the table
    rule = cfg.update_rule()
    assert rule.kwargs == {"weight_decay": 0.01} and str(rule.schedule) == "warmup:10,cosine:100"
    args = build_parser().parse_args(["train", "--config", str(path)])
    cfg = TrainConfig(**config_values(args)).validate(command_line=True)
    assert cfg.update_rule().kwargs == {"betas": (0.8, 0.9), "amsgrad": True}
    assert cfg.update_rule().state_names == ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    args = build_parser().parse_args(["train", "--config", str(again)])
    assert TrainConfig(**config_values(args)).validate(command_line=True) == cfg


BAD_CONFIG = [
    (None, "--config {path}: no such file: check the path"),
    ("[downpour\n", "--config {path} is not valid TOML ("),
    ("[optimizers]\nlr = 1.0\n", "unknown section [optimizers]: use [data]"),
    ("[downpour]\nn_fetches = 2\n", "[downpour] has no option 'n_fetches'"),
    ("[model]\nreplicas = 2\n", "replicas belongs in [parallelism], not [model]"),
    ("[parallelism]\nreplicas = \"two\"\n", "replicas = \"two\" must be an integer"),
    ("[parallelism]\nreplicas = 0\n", "--replicas must be an integer >= 1"),
    ("[downpour]\noptimizer_args = 3\n",
     "[downpour] optimizer_args must be a table of name = value"),
    ("[downpour]\noptimizer = \"adam\"\noptimizer_args = { nope = 1 }\n",
     "--optimizer-arg nope: torch.optim.Adam (--optimizer adam) takes no 'nope'"),
]


@pytest.mark.parametrize("text,message", BAD_CONFIG, ids=[m for _, m in BAD_CONFIG])
def test_bad_config_file_is_one_line_exit_2_and_starts_nothing(text, message, tmp_path,
                                                                capsys):
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    run_dir = tmp_path / "run"
    code = run_cli(["train", "--config", str(path), "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("distbelief: error: ") and message.format(path=path) in lines[0]
    assert not ray.is_initialized() and not run_dir.exists()


def test_readme_lists_every_train_flag():
    """README's command-line summary names every flag `distbelief train` has."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Command line"):readme.index("## Python API")]
    missing = [flag(name) for name in FIELDS if flag(name) not in section]
    assert not missing, f"README.md's Command line section lacks {missing}"
