"""sources: arrays, a torch Dataset and per-replica streams as replicas' batch sources."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from distbelief.data import ReplicaSampler
from distbelief.errors import UserError
from distbelief.ondisk import DiskRows, write_arrays
from distbelief.sources import ArrayRows, Rows, TorchRows, as_rows, replica_stream, sampled_batches


def data(n: int = 50):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 4, n)


def test_arrays_a_torch_dataset_and_a_data_folder_serve_the_same_sampled_batches(tmp_path):
    x, y = data()
    write_arrays(tmp_path / "d", x, y, x[:5], y[:5], rows_per_file=7)
    sources = [as_rows((x, y)), as_rows(TensorDataset(torch.from_numpy(x), torch.from_numpy(y))),
               as_rows(DiskRows(tmp_path / "d"))]
    assert isinstance(sources[0], ArrayRows) and isinstance(sources[1], TorchRows)
    assert all(isinstance(s, Rows) and len(s) == 50 and s.feature_shape == (3,)
               for s in sources)
    sampler = ReplicaSampler(50, 1, 3, 4, seed=7)
    streams = [sampled_batches(s, 1, 3, 4, seed=7, start_step=2) for s in sources]
    for step in range(2, 12):
        expected = sampler.batch(step)
        for stream in streams:
            bx, by = next(stream)
            np.testing.assert_array_equal(bx, x[expected])
            np.testing.assert_array_equal(by, y[expected])
            assert bx.dtype == np.float32 and by.dtype == np.int64


def test_a_torch_dataset_must_be_map_style_nonempty_with_integer_labels():
    with pytest.raises(UserError, match="not a map-style Dataset"):
        TorchRows(iter([]))
    with pytest.raises(UserError, match="Dataset is empty"):
        TorchRows(TensorDataset(torch.zeros(0, 2), torch.zeros(0)))
    with pytest.raises(UserError, match="labels are float32, not integers"):
        TorchRows(TensorDataset(torch.zeros(3, 2), torch.zeros(3)))
    with pytest.raises(UserError, match=r"gave a Tensor, not an \(x, y\) pair"):
        TorchRows(torch.zeros(3, 2, 2, 2))


def loader_factory(replica: int, replicas: int, seed: int):
    """Each replica builds its own loader over its own rows."""
    x, y = data()
    mine = slice(replica, None, replicas)
    own = TensorDataset(torch.from_numpy(x[mine]), torch.from_numpy(y[mine]))
    return DataLoader(own, batch_size=5, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def test_a_stream_factory_gives_each_replica_its_own_rows_and_restarts_each_epoch():
    x, _ = data()
    stream = replica_stream(loader_factory, 1, 2, seed=3, feature_shape=(3,))
    batches = [next(stream) for _ in range(12)]  # 25 rows = 5 batches an epoch
    seen = np.concatenate([b[0] for b in batches[:5]])
    np.testing.assert_array_equal(np.sort(seen, axis=0), np.sort(x[1::2], axis=0))
    np.testing.assert_array_equal(batches[5][0], batches[0][0])  # same seed, same epoch order
    assert all(b[0].dtype == np.float32 and b[1].dtype == np.int64 for b in batches)


def generator_of(*batches):
    return lambda replica, replicas, seed: iter(batches)


@pytest.mark.parametrize("factory, match", [
    (lambda r, n, s: 1 / 0, r"raised ZeroDivisionError: division by zero: it must take "
                            r"\(replica, replicas, seed\)"),
    (lambda: [], "raised TypeError"),
    (generator_of(), "gave replica 0 no batches"),
    (generator_of(np.zeros((2, 3))), r"not an \(x, y\) pair"),
    (generator_of((np.zeros((2, 3)), np.zeros(3, np.int64))), "give one label per row"),
    (generator_of((np.zeros((2, 4)), np.zeros(2, np.int64))), r"rows of shape \(4,\), not"),
    (generator_of((np.zeros((2, 3)), np.zeros(2))), "not integers"),
])
def test_a_bad_stream_is_one_line(factory, match):
    with pytest.raises(UserError, match=match) as info:
        next(replica_stream(factory, 0, 2, 0, feature_shape=(3,)))
    assert "\n" not in str(info.value)
