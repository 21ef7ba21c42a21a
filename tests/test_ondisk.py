"""ondisk: the data-folder layout, its writers, and DiskRows reading rows across files."""

import json
import pickle

import numpy as np
import pytest

from distbelief.errors import UserError
from distbelief.ondisk import DiskRows, is_data_dir, write_arrays, write_chunks


def arrays(n: int = 103, shape=(4,), seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    return x, rng.integers(0, 5, n).astype(np.int64)


@pytest.fixture
def folder(tmp_path):
    x, y = arrays()
    xt, yt = arrays(21, seed=1)
    write_arrays(tmp_path / "d", x, y, xt, yt, rows_per_file=10, classes=5)
    return tmp_path / "d", x, y, xt, yt


def test_rows_are_gathered_by_global_index_across_files_in_any_order(folder):
    path, x, y, xt, yt = folder
    train, test = DiskRows(path), DiskRows(path, "test")
    assert is_data_dir(path) and len(train) == 103 and len(test) == 21
    assert train.feature_shape == (4,) and train.classes == 5
    assert len(list(path.glob("train-x-*.npy"))) == 11
    idx = np.array([102, 0, 55, 9, 10, 55, 31])
    got_x, got_y = train.rows(idx)
    np.testing.assert_array_equal(got_x, x[idx])
    np.testing.assert_array_equal(got_y, y[idx])
    assert got_x.dtype == np.float32 and got_y.dtype == np.int64
    all_test = [b for b in test.batches(8)]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in all_test]), xt)
    assert train.rows(np.array([], np.int64))[0].shape == (0, 4)
    with pytest.raises(IndexError):
        train.rows(np.array([103]))


def test_image_rows_keep_their_shape_and_a_reader_pickles_as_its_path(tmp_path):
    x, y = arrays(30, shape=(1, 6, 6))
    write_arrays(tmp_path / "img", x, y, x[:5], y[:5], rows_per_file=7)
    rows = DiskRows(tmp_path / "img")
    assert rows.feature_shape == (1, 6, 6)
    blob = pickle.dumps(rows)
    assert len(blob) < 300  # the path, not the data
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again.rows(np.arange(30))[0], x)


def test_chunks_from_an_iterator_are_written_one_at_a_time(tmp_path):
    def chunks(count: int):
        for i in range(count):
            yield arrays(8, seed=i)

    write_chunks(tmp_path / "it", chunks(5), chunks(1))
    rows = DiskRows(tmp_path / "it")
    assert len(rows) == 40 and rows.classes == 5
    np.testing.assert_array_equal(rows.rows(np.arange(8, 16))[1], arrays(8, seed=1)[1])


@pytest.mark.parametrize("train, test, match", [
    ([arrays(5, seed=0), arrays(5, shape=(3,))], [arrays(2)], "rows of shape"),
    ([(np.zeros((3, 2)), np.zeros(3))], [arrays(2)], "integer array"),
    ([(np.zeros((3, 2)), np.zeros(2, np.int64))], [arrays(2)], "one label per row"),
    ([(np.full((3, 2), np.nan), np.zeros(3, np.int64))], [arrays(2)], "NaN or inf"),
    ([(np.zeros((3, 2)), -np.ones(3, np.int64))], [arrays(2)], "labels must be 0..classes-1"),
    ([arrays(5)], [], "the test split has no rows"),
])
def test_bad_chunks_are_one_line_errors_and_leave_no_meta(tmp_path, train, test, match):
    with pytest.raises(UserError, match=match):
        write_chunks(tmp_path / "bad", train, test)
    assert not is_data_dir(tmp_path / "bad")


def test_writing_into_a_used_folder_is_refused(folder):
    path, x, y, xt, yt = folder
    with pytest.raises(UserError, match="is not an empty folder: write the data set to a new"):
        write_arrays(path, x, y, xt, yt)


def break_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, match", [
    (lambda p: (p / "train-x-00003.npy").unlink(), "train-x-00003.npy is missing"),
    (lambda p: (p / "train-y-00010.npy").write_bytes(b"garbage"), "is not a readable .npy"),
    (lambda p: (p / "train-x-00002.npy").write_bytes(
        (p / "train-x-00002.npy").read_bytes()[:-8]), "train-x-00002.npy is not a readable"),
    (lambda p: np.save(p / "train-x-00001.npy", np.zeros((10, 5), np.float32)),
     r"holds float32 \(10, 5\), but meta.json says float32 \(10, 4\)"),
    (lambda p: np.save(p / "test-y-00000.npy", np.zeros(10, np.int32)), "holds int32"),
    (lambda p: np.save(p / "train-y-00000.npy", np.array([{}, 1], dtype=object)),
     "not a readable .npy"),
    (lambda p: (p / "meta.json").unlink(), "has no meta.json: write the folder with"),
    (lambda p: (p / "meta.json").write_text("{"), "meta.json is not readable JSON"),
    (lambda p: break_meta(p, format="other"), "is not a distbelief-rows version 1 file"),
    (lambda p: break_meta(p, train=[10, 0]), "positive row counts"),
    (lambda p: break_meta(p, feature_shape=None), "lacks or garbles"),
])
def test_a_missing_corrupt_or_mismatched_file_is_one_line(folder, damage, match):
    path = folder[0]
    damage(path)
    with pytest.raises(UserError, match=match) as info:
        DiskRows(path)
        DiskRows(path, "test")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"--dataset {path}")


def test_no_such_folder_and_unknown_split(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        DiskRows(tmp_path / "nope")
    with pytest.raises(UserError, match="split 'val' is unknown"):
        DiskRows(tmp_path, "val")


def test_the_tool_writes_a_shipped_data_set_as_a_folder(tmp_path, capsys):
    from distbelief.data import digits
    from distbelief.ondisk import main

    assert main(["digits", str(tmp_path / "d"), "--rows-per-file", "500"]) == 0
    rows, ds = DiskRows(tmp_path / "d"), digits()
    assert len(rows) == len(ds.y_train) and rows.classes == 10
    np.testing.assert_array_equal(rows.rows(np.arange(len(rows)))[0], ds.x_train)
    assert main(["digits", str(tmp_path / "d")]) == 2  # not empty
    assert main(["cifar", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is not an empty folder" in err[0] and "is unknown" in err[1]
