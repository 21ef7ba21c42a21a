"""Re-sharding a checkpoint onto another shard count (pure: reshard.py and checkpoint.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.checkpoint import (
    load_checkpoint,
    load_row_shard,
    load_row_shards,
    load_shard,
    save_arrays,
    shard_file,
    write_manifest,
)
from distbelief.errors import UserError
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ShardCore
from distbelief.reshard import owner, reshard_dense, reshard_rows
from distbelief.sparse.shard import EmbeddingShardCore
from distbelief.sparse.table import TableSpec

shapes = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=4)


def random_parts(plan: ShardPlan, seed: int, steps: list[float]) -> list[dict]:
    """Shard files as a Downpour shard writes them: per-element params, two rule-state
    arrays, an --average and a Sandblaster vector; a scalar rule state ``step`` and
    ``average_count`` per shard; model buffers on shard 0."""
    rng = np.random.default_rng(seed)
    parts = []
    for i in range(plan.shards):
        n = plan.shard_size(i)
        part = {name: rng.standard_normal(n).astype(np.float32)
                for name in ("params", "exp_avg", "exp_avg_sq", "average", "vec:g")}
        part["step"] = np.array([steps[i]], np.float32)
        part["average_count"] = np.array([int(steps[i])], np.int64)
        if i == 0:
            part["buffers"] = rng.standard_normal(3).astype(np.float32)
            part["buffer_counts"] = np.array([1, 2, 3], np.int64)
        parts.append(part)
    return parts


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, old=st.integers(1, 6), new=st.integers(1, 6), seed=st.integers(0, 99))
def test_reshard_dense_keeps_every_gathered_array_bit_for_bit(shapes, old, new, seed):
    named = [(f"t{i}", s) for i, s in enumerate(shapes)]
    total = sum(a * b for a, b in shapes)
    old, new = min(old, total), min(new, total)
    before, after = ShardPlan.build(named, old), ShardPlan.build(named, new)
    steps = [float(10 + i) for i in range(old)]
    parts = random_parts(before, seed, steps)
    versions = [100 + i for i in range(old)]
    out, out_versions = reshard_dense(before, parts, versions, after, ["step"])
    assert len(out) == new and len(out_versions) == new
    for name in ("params", "exp_avg", "exp_avg_sq", "average", "vec:g"):
        gathered = np.concatenate([p[name] for p in parts])
        assert np.concatenate([p[name] for p in out]).tobytes() == gathered.tobytes()
        assert [p[name].shape for p in out] == [(after.shard_size(j),) for j in range(new)]
    for j, part in enumerate(out):
        src = owner(before.bounds, *after.shard_range(j))
        assert part["step"][0] == steps[src] and part["average_count"][0] == int(steps[src])
        assert out_versions[j] == versions[src]
        assert ("buffers" in part) == (j == 0) and ("buffer_counts" in part) == (j == 0)
    np.testing.assert_array_equal(out[0]["buffers"], parts[0]["buffers"])
    back, back_versions = reshard_dense(after, out, out_versions, before, ["step"])
    if len(set(steps)) == 1 or old == new:
        for a, b in zip(back, parts):
            assert sorted(a) == sorted(b)
            assert all(a[k].tobytes() == b[k].tobytes() for k in a)


@given(bounds=st.lists(st.integers(1, 50), min_size=1, max_size=6, unique=True),
       lo=st.integers(0, 50), width=st.integers(1, 20))
def test_owner_holds_at_least_as_much_of_the_range_as_any_other_shard(bounds, lo, width):
    cuts = [0, *sorted(bounds)]
    hi = lo + width

    def overlap(i):
        return max(0, min(hi, cuts[i + 1]) - max(lo, cuts[i]))

    best = owner(cuts, lo, hi)
    assert all(overlap(best) >= overlap(i) for i in range(len(cuts) - 1))


def test_reshard_dense_refuses_another_model_or_a_short_part():
    a = ShardPlan.build([("w", (6,))], 2)
    parts = random_parts(a, 0, [1.0, 1.0])
    with pytest.raises(ValueError, match="different models"):
        reshard_dense(a, parts, [0, 0], ShardPlan.build([("v", (6,))], 3), ["step"])
    parts[1]["exp_avg"] = parts[1]["exp_avg"][:2]
    with pytest.raises(ValueError, match="lacks a per-element 'exp_avg' of 3"):
        reshard_dense(a, parts, [0, 0], ShardPlan.build([("w", (6,))], 3), ["step"])


@settings(max_examples=60, deadline=None)
@given(rows=st.sets(st.integers(0, 199), max_size=40), old=st.integers(1, 5),
       new=st.integers(1, 5), seed=st.integers(0, 99))
def test_reshard_rows_moves_each_row_with_its_values_and_state(rows, old, new, seed):
    rng = np.random.default_rng(seed)
    rows = np.array(sorted(rows), np.int64)
    values = rng.standard_normal((rows.size, 3)).astype(np.float32)
    acc = rng.random((rows.size, 3)).astype(np.float32)
    parts = []
    for s in range(old):
        mine = rows % old == s
        parts.append({"emb/rows": rows[mine], "emb/values": values[mine],
                      "emb/accumulator": acc[mine]})
    out, versions = reshard_rows(parts, list(range(7, 7 + old)), new)
    assert versions == [6 + old] * new
    seen = np.concatenate([p["emb/rows"] for p in out])
    assert sorted(seen.tolist()) == rows.tolist()
    for s, part in enumerate(out):
        assert np.all(part["emb/rows"] % new == s) and np.all(np.diff(part["emb/rows"]) > 0)
        where = np.searchsorted(rows, part["emb/rows"])
        assert part["emb/values"].tobytes() == values[where].tobytes()
        assert part["emb/accumulator"].tobytes() == acc[where].tobytes()


def test_reshard_rows_refuses_a_row_held_twice():
    part = {"emb/rows": np.array([1, 2], np.int64), "emb/values": np.zeros((2, 1), np.float32)}
    with pytest.raises(ValueError, match="held by two old shards"):
        reshard_rows([part, dict(part)], [0, 0], 3)


# checkpoint.py: a 2-shard checkpoint read on 3 shards and on 1.

def write_two_shard_checkpoint(run_dir) -> tuple[ShardPlan, list[ShardCore]]:
    plan = ShardPlan.build([("w", (4, 3)), ("b", (5,))], 2)
    cores = [ShardCore(i, np.arange(plan.shard_size(i), dtype=np.float32) + 10 * i,
                       Adagrad(0.1)) for i in range(2)]
    rng = np.random.default_rng(0)
    for _ in range(3):
        for core in cores:
            core.push(rng.standard_normal(core.params.size).astype(np.float32), 0, replica=0)
    (run_dir / "checkpoints").mkdir()
    for i, core in enumerate(cores):
        core.save(shard_file(run_dir, 1, i))
    write_manifest(run_dir, 1, [c.version for c in cores], plan, ["accumulator"], {})
    return plan, cores


@pytest.mark.parametrize("shards", [3, 1])
def test_load_checkpoint_reshards_params_and_adagrad_state(tmp_path, shards):
    plan, cores = write_two_shard_checkpoint(tmp_path)
    target = ShardPlan.build([(t.name, t.shape) for t in plan.tensors], shards)
    manifest, parts = load_checkpoint(tmp_path, 1, target, ["accumulator"])
    assert manifest["resharded_from"] == 2 and manifest["bounds"] == list(target.bounds)
    assert len(parts) == len(manifest["shards"]) == shards
    for name, source in (("params", "params"), ("accumulator", "accumulator")):
        want = np.concatenate([c.params if name == "params" else c.state[source]
                               for c in cores])
        assert np.concatenate([p[name] for p in parts]).tobytes() == want.tobytes()
    assert all(e["version"] == 3 and e["counters"] is None for e in manifest["shards"])
    one = load_shard(tmp_path, 1, shards - 1, target, ["accumulator"])
    assert one["arrays"]["params"].tobytes() == parts[-1]["params"].tobytes()
    restored = ShardCore(0, np.zeros(target.shard_size(0), np.float32), Adagrad(0.1))
    restored.restore(parts[0], manifest["shards"][0]["version"])
    assert restored.version == 3


def test_load_checkpoint_of_another_model_is_refused(tmp_path):
    write_two_shard_checkpoint(tmp_path)
    with pytest.raises(UserError, match="is of a different model"):
        load_checkpoint(tmp_path, 1, ShardPlan.build([("w", (17,))], 3), ["accumulator"])


@pytest.mark.parametrize("shards", [3, 1])
def test_row_checkpoint_regroups_rows_for_another_count(tmp_path, shards):
    spec = TableSpec("emb", 50, 2, seed=1)
    cores = [EmbeddingShardCore(i, 2, [spec], "adagrad", 0.1) for i in range(2)]
    for core in cores:
        rows = np.arange(core.shard_id, 50, 2 * 3, dtype=np.int64)
        core.push({"emb": (rows, np.ones((rows.size, 2), np.float32))}, 0)
    (tmp_path / "checkpoints").mkdir()
    entries = []
    for i, core in enumerate(cores):
        path = shard_file(tmp_path, 1, i, "rowshard")
        entries.append({"file": path.rsplit("/", 1)[-1], "version": core.save(path)})
    save_arrays(shard_file(tmp_path, 1, 0), {"params": np.zeros(1, np.float32)})
    write_manifest(tmp_path, 1, [0], ShardPlan.build([("w", (1,))], 1), [],
                   {"row_shards": entries})
    parts = load_row_shards(tmp_path, 1, shards)
    fresh = [EmbeddingShardCore(i, shards, [spec], "adagrad", 0.1, restored=p)
             for i, p in enumerate(parts)]
    rows = np.arange(50, dtype=np.int64)
    for table in ("values", "accumulator"):
        old = {int(r): v for c in cores for r, v in zip(c.tables["emb"].snapshot()["rows"],
                                                        c.tables["emb"].snapshot()[table])}
        new = {int(r): v for c in fresh for r, v in zip(c.tables["emb"].snapshot()["rows"],
                                                        c.tables["emb"].snapshot()[table])}
        assert sorted(old) == sorted(new)
        assert all(old[r].tobytes() == new[r].tobytes() for r in old)
    got = np.concatenate([c.fetch({"emb": rows[rows % shards == c.shard_id]})[1]["emb"]
                          for c in fresh])
    want = np.concatenate([c.fetch({"emb": rows[rows % 2 == c.shard_id]})[1]["emb"]
                           for c in cores])
    order_new = np.argsort(np.concatenate([rows[rows % shards == s] for s in range(shards)]))
    order_old = np.argsort(np.concatenate([rows[rows % 2 == s] for s in range(2)]))
    assert got[order_new].tobytes() == want[order_old].tobytes()
    assert load_row_shard(tmp_path, 1, 0, shards)["version"] == max(c.version for c in cores)
