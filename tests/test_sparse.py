"""Row-sparse tables, the SparseEmbedding module and the ctr data, without Ray."""

import re

import numpy as np
import pytest
import torch

from distbelief.errors import UserError
from distbelief.ps.optim import make_rule
from distbelief.sparse.ctr import (
    auc,
    ctr_from_npz,
    hidden_weights,
    synthetic_ctr,
    truth_logits,
    zipf_ranks,
)
from distbelief.sparse.module import (
    LocalTables,
    SparseEmbedding,
    prefetch_rows,
    push_rows,
    sparse_modules,
)
from distbelief.sparse.shard import EmbeddingShardCore
from distbelief.sparse.table import RowTable, TableSpec, dedupe, initial_rows

SPEC = TableSpec("emb", rows=1000, dim=4, init_scale=0.1, seed=3)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd", "momentum"])
def test_row_sparse_update_equals_dense_rule_restricted_to_touched_rows(optimizer):
    rule = make_rule(optimizer, 0.1, rows=True)
    rng = np.random.default_rng(0)
    table = RowTable(SPEC, rule)
    dense = initial_rows(SPEC, np.arange(SPEC.rows))  # the whole table, dense
    state = {k: np.zeros_like(dense) for k in rule.state_names}
    touched_ever = np.zeros(SPEC.rows, bool)
    for _ in range(6):
        rows = rng.choice(SPEC.rows, size=30)  # with duplicates
        grads = rng.standard_normal((30, SPEC.dim)).astype(np.float32)
        assert table.push(rows, grads) is None
        # reference: the dense rule on the summed dense gradient, applied to touched rows only
        g = np.zeros_like(dense)
        np.add.at(g, rows, grads)
        hit = np.unique(rows)
        sub = {k: v[hit] for k, v in state.items()}
        param = dense[hit]
        rule.apply(param, g[hit], sub)
        dense[hit] = param
        for k, v in sub.items():
            state[k][hit] = v
        touched_ever[hit] = True
    np.testing.assert_allclose(table.fetch(np.arange(SPEC.rows)), dense, rtol=1e-6, atol=1e-7)
    assert table.materialized == touched_ever.sum()
    for k in rule.state_names:  # rule state exists for touched rows only
        slots = np.array([table.slots[r] for r in np.flatnonzero(touched_ever)])
        np.testing.assert_allclose(table.state[k][slots], state[k][touched_ever], rtol=1e-6)


def test_adagrad_on_rows_matches_the_dense_adagrad_rule_on_the_whole_table():
    # all-rows pushes: the sparse path must equal ps/optim's dense Adagrad exactly
    rule = make_rule("adagrad", 0.05, rows=True)
    table = RowTable(SPEC, rule)
    dense = initial_rows(SPEC, np.arange(SPEC.rows)).reshape(-1)
    acc = {"accumulator": np.zeros_like(dense)}
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = rng.standard_normal((SPEC.rows, SPEC.dim)).astype(np.float32)
        table.push(np.arange(SPEC.rows)[::-1].copy(), g[::-1].copy())  # order must not matter
        rule.apply(dense, g.reshape(-1), acc)
    np.testing.assert_allclose(table.fetch(np.arange(SPEC.rows)).reshape(-1), dense, rtol=1e-6)


def test_lazy_rows_are_seeded_and_independent_of_touch_order():
    rows = np.array([5, 999, 0, 17, 5])
    a = RowTable(SPEC, make_rule("sgd", 0.1, rows=True))
    b = RowTable(SPEC, make_rule("sgd", 0.1, rows=True))
    b.fetch(np.array([17]))
    b.push(np.array([999, 3]), np.zeros((2, SPEC.dim), np.float32))  # materialise some first
    np.testing.assert_array_equal(a.fetch(rows), b.fetch(rows))
    np.testing.assert_array_equal(a.fetch(rows)[0], a.fetch(rows)[4])
    one_by_one = np.concatenate([initial_rows(SPEC, np.array([r])) for r in rows])
    np.testing.assert_array_equal(initial_rows(SPEC, rows), one_by_one)
    assert a.materialized == 0  # fetching creates nothing
    other_seed = TableSpec("emb", 1000, 4, 0.1, seed=4)
    other_name = TableSpec("emb2", 1000, 4, 0.1, seed=3)
    for spec in (other_seed, other_name):
        assert not np.allclose(initial_rows(spec, rows), initial_rows(SPEC, rows))
    values = initial_rows(SPEC, np.arange(1000))
    assert np.abs(values).max() <= 0.1 and abs(values.mean()) < 0.01
    assert np.all(initial_rows(TableSpec("z", 10, 2, 0.0), np.arange(10)) == 0)


def test_a_huge_nominal_table_costs_only_its_touched_rows():
    spec = TableSpec("big", rows=10**12, dim=16)
    table = RowTable(spec, make_rule("adagrad", 0.1, rows=True))
    rows = np.array([0, 10**12 - 1, 123456789012])
    table.push(rows, np.ones((3, 16), np.float32))
    assert table.materialized == 3
    assert table.resident_bytes < 1024 * 16 * 4 * 2 + 1  # the first growth step, not 10**12
    assert table.fetch(rows).shape == (3, 16)


BAD_PUSHES = [
    (np.array([1000]), np.ones((1, 4), np.float32), "range", "row 1000 is out of range 0..999"),
    (np.array([-1]), np.ones((1, 4), np.float32), "range", "row -1 is out of range"),
    (np.array([1.0]), np.ones((1, 4), np.float32), "rows", "row ids have dtype float64"),
    (np.array([[1]]), np.ones((1, 4), np.float32), "rows", "must be a 1-D integer array"),
    (np.array([1]), np.ones((1, 4)), "dtype", "gradients have dtype float64, need float32"),
    (np.array([1]), np.ones((1, 3), np.float32), "shape", "need (1, 4) for 1 rows"),
    (np.array([1, 2]), np.array([[0, 0, 0, np.nan]] * 2, np.float32), "nonfinite", "NaN or inf"),
    (np.array([1]), [[1.0, 1, 1, 1]], "type", "must be a NumPy array"),
]


@pytest.mark.parametrize("rows,grads,reason,message", BAD_PUSHES, ids=[b[2] for b in BAD_PUSHES])
def test_bad_pushes_are_rejected_with_a_clear_message_and_change_nothing(rows, grads, reason,
                                                                          message):
    table = RowTable(SPEC, make_rule("adagrad", 0.1, rows=True))
    before = table.fetch(np.array([1, 2]))
    problem = table.push(rows, grads)
    assert problem is not None and message in problem and "\n" not in problem
    assert table.rejected == {reason: 1}
    assert table.materialized == 0 and table.updates == 0
    np.testing.assert_array_equal(table.fetch(np.array([1, 2])), before)
    if reason in ("range", "rows"):
        with pytest.raises(ValueError, match="row"):
            table.fetch(rows)


def test_shard_owns_rows_modulo_shards_and_rejects_whole_pushes():
    specs = [SPEC, TableSpec("wide", 1000, 1, 0.0)]
    shard = EmbeddingShardCore(1, 4, specs, "adagrad", 0.1)
    ok = {"emb": (np.array([1, 5, 9]), np.ones((3, 4), np.float32)),
          "wide": (np.array([13]), np.ones((1, 1), np.float32))}
    assert shard.push(ok, 0) is None
    assert shard.version == 1
    wrong_shard = {"emb": (np.array([1]), np.ones((1, 4), np.float32)),
                   "wide": (np.array([2]), np.ones((1, 1), np.float32))}
    problem = shard.push(wrong_shard, 0)
    assert "row 2 belongs to shard 2, not shard 1" in problem
    assert shard.tables["emb"].updates == 1  # the valid part was not applied either
    assert "no table 'deep'" in shard.push({"deep": ok["emb"]}, 0)
    out_of_range = {"emb": (np.array([1001]), np.ones((1, 4), np.float32))}
    assert "row 1001 is out of range 0..999" in shard.push(out_of_range, 0)
    stats = shard.stats()
    assert stats["rejected"] == {"shard": 1, "table": 1, "range": 1}
    assert stats["tables"]["emb"]["materialized"] == 3
    version, values = shard.fetch({"emb": np.array([5, 5, 101])})
    assert version == 1 and values["emb"].shape == (3, 4)
    with pytest.raises(ValueError, match="no table"):
        shard.fetch({"nope": np.array([1])})


def test_dedupe_sums_duplicate_rows():
    rows, grads = dedupe(np.array([3, 1, 3]), np.array([[1.0], [2.0], [4.0]], np.float32))
    np.testing.assert_array_equal(rows, [1, 3])
    np.testing.assert_array_equal(grads, [[2.0], [5.0]])


def test_sparse_embedding_matches_nn_embedding_and_yields_row_gradients():
    spec_rows, dim = 50, 3
    ids = torch.tensor([[1, 7, 7], [49, 1, 0]])
    for mode in ("sum", "mean", "concat"):
        emb = SparseEmbedding(spec_rows, dim, "e", mode=mode, init_scale=0.5, seed=1)
        emb.attach(LocalTables([emb.spec], "sgd", 1.0))
        ref = torch.nn.Embedding(spec_rows, dim)
        with torch.no_grad():
            ref.weight.copy_(torch.from_numpy(initial_rows(emb.spec, np.arange(spec_rows))))
        out = emb(ids)  # fetch on miss
        expect = ref(ids)
        expect = {"sum": expect.sum(1), "mean": expect.mean(1),
                  "concat": expect.reshape(2, -1)}[mode]
        torch.testing.assert_close(out, expect)
        weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape)
        (out * weights).sum().backward()
        (expect * weights).sum().backward()
        rows, grads = emb.row_grads()
        np.testing.assert_array_equal(rows, [0, 1, 7, 49])
        np.testing.assert_allclose(grads, ref.weight.grad[rows].numpy(), rtol=1e-6)
        assert emb.misses == 1
    assert len(list(emb.parameters())) == 0  # the table is not part of the dense plan


def test_training_step_through_local_tables_updates_only_touched_rows():
    emb = SparseEmbedding(100, 2, "e", init_scale=0.1)
    tables = LocalTables([emb.spec], "sgd", 0.5)
    emb.attach(tables)
    ids = torch.tensor([[3, 4]])
    before = tables.fetch_many({"e": np.arange(100)})["e"]
    assert prefetch_rows(emb, ids) == 2
    emb(ids).sum().backward()
    push_rows([emb])
    after = tables.fetch_many({"e": np.arange(100)})["e"]
    np.testing.assert_allclose(after[[3, 4]], before[[3, 4]] - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(np.delete(after, [3, 4], 0), np.delete(before, [3, 4], 0))
    assert emb.rows.size == 0  # the stale buffer was dropped
    with pytest.raises(RuntimeError, match="not prefetched and no source"):
        SparseEmbedding(10, 2, "x")(torch.tensor([[1]]))


def test_table_names_must_be_unique_in_a_model():
    model = torch.nn.ModuleList([SparseEmbedding(5, 2, "a"), SparseEmbedding(5, 2, "a")])
    with pytest.raises(ValueError, match="unique"):
        sparse_modules(model)


def test_auc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.random(500) < 0.3
    s = np.round(rng.random(500) + y * 0.3, 1)  # many ties
    assert auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_ctr_is_seeded_zipf_and_labelled_by_the_hidden_model():
    a, b = synthetic_ctr(4000, 8000, seed=2), synthetic_ctr(4000, 8000, seed=2)
    np.testing.assert_array_equal(a.ids_train, b.ids_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.ids_train.shape[1] == 8 and a.ids_train.dtype == np.int64
    per_field = 8000 // 8
    fields = a.ids_train // per_field
    assert np.all(fields == np.arange(8))  # field f's ids lie in its own block of rows
    ranks = a.ids_train % per_field
    assert (ranks == 0).mean() > 10 * (ranks == 50).mean()  # a heavy head
    np.testing.assert_allclose(a.truth_test, 1 / (1 + np.exp(-truth_logits(a.ids_test, 2))))
    assert 0.6 < a.truth_auc() < 0.95
    assert synthetic_ctr(4000, 8000, seed=3).truth_auc() != a.truth_auc()
    # hidden weights are a pure function of (seed, row): no table behind them
    np.testing.assert_array_equal(hidden_weights(np.array([10**9]), 0),
                                  hidden_weights(np.array([10**9]), 0))
    u = np.random.default_rng(0).random(10000)
    r = zipf_ranks(u, 10**7)
    assert r.min() >= 0 and r.max() < 10**7


def write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


NPZ = [
    ({"labels": np.zeros(4)}, "lacks ids"),
    ({"ids": np.zeros((4, 2), np.int64)}, "lacks labels"),
    ({"ids": np.zeros((4, 2)), "labels": np.zeros(4)}, "ids must be a 2-D integer array"),
    ({"ids": np.zeros((4, 2), np.int64), "labels": np.zeros(3)}, "one entry per row of ids"),
    ({"ids": np.zeros((4, 2), np.int64), "labels": np.full(4, 0.5)}, "labels must be 0 or 1"),
    ({"ids": np.full((4, 2), 100), "labels": np.zeros(4)}, "pass --rows 101 or more"),
    ({"ids": np.full((4, 2), -1), "labels": np.zeros(4)}, "ids must be >= 0"),
]


@pytest.mark.parametrize("arrays,message", NPZ, ids=[m for _, m in NPZ])
def test_ctr_npz_problems_are_one_line_user_errors(tmp_path, arrays, message):
    path = write(tmp_path / "clicks.npz", **arrays)
    with pytest.raises(UserError, match=message) as err:
        ctr_from_npz(path, rows=100)
    assert "\n" not in str(err.value)


def test_ctr_npz_loads_and_splits(tmp_path):
    ids = np.arange(40, dtype=np.int32).reshape(20, 2)
    path = write(tmp_path / "clicks.npz", ids=ids, labels=np.arange(20) % 2)
    data = ctr_from_npz(path, rows=40)
    assert len(data.ids_train) == 16 and len(data.ids_test) == 4
    assert data.ids_train.dtype == np.int64 and data.y_train.dtype == np.float32
    assert data.truth_auc() is None
    with pytest.raises(UserError, match="no such file"):
        ctr_from_npz(str(tmp_path / "missing.npz"), rows=40)


def test_shard_save_and_restore_carry_rows_rule_state_and_version_exactly(tmp_path):
    specs = [TableSpec("deep", 500, 4, 0.1, 3), TableSpec("wide", 500, 1, 0.0, 3)]
    gen = np.random.default_rng(0)

    def pushes(shard, n):
        for _ in range(n):
            rows = gen.integers(0, 250, 40) * 2 + 1  # shard 1 of 2 owns the odd rows
            request = {s.name: (rows, gen.normal(size=(40, s.dim)).astype(np.float32))
                       for s in specs}
            assert shard.push(request, shard.version) is None

    original = EmbeddingShardCore(1, 2, specs, "adagrad", 0.1)
    pushes(original, 5)
    path = tmp_path / "rows.safetensors"
    assert original.save(str(path)) == 5
    from distbelief.checkpoint import load_arrays

    copy = EmbeddingShardCore(1, 2, specs, "adagrad", 0.1,
                              restored={"arrays": load_arrays(path), "version": 5})
    assert copy.version == 5
    for s in specs:
        a, b = original.tables[s.name].snapshot(), copy.tables[s.name].snapshot()
        assert set(a) == {"rows", "values", "accumulator"} == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    gen = np.random.default_rng(1)  # the same further pushes to both: Adagrad state carried
    pushes(original, 3)
    gen = np.random.default_rng(1)
    pushes(copy, 3)
    rows = np.arange(1, 500, 2)
    for s in specs:
        np.testing.assert_array_equal(original.tables[s.name].fetch(rows),
                                      copy.tables[s.name].fetch(rows))


def test_restore_refuses_rows_of_another_model_shard_or_rule_and_changes_nothing(tmp_path):
    specs = [TableSpec("deep", 100, 2, 0.1, 0)]
    shard = EmbeddingShardCore(0, 2, specs, "adagrad", 0.1)
    shard.push({"deep": (np.array([0, 2]), np.ones((2, 2), np.float32))}, 0)
    good = {f"deep/{k}": v for k, v in shard.tables["deep"].snapshot().items()}
    before = shard.tables["deep"].snapshot()
    cases = [
        ({**good, "other/rows": good["deep/rows"]}, "not a table of this model"),
        ({**good, "deep/rows": np.array([1, 2])}, "row 1 belongs to shard 1"),
        ({**good, "deep/rows": np.array([2, 0])}, "sorted unique int64"),
        ({k: v for k, v in good.items() if k != "deep/accumulator"}, "lacks ['accumulator']"),
        ({**good, "deep/values": np.ones((2, 3), np.float32)}, "need float32 (2, 2)"),
        ({**good, "deep/values": np.full((2, 2), np.nan, np.float32)}, "NaN or inf"),
    ]
    for arrays, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            shard.restore(arrays, 7)
        assert shard.version == 1
        after = shard.tables["deep"].snapshot()
        for key in before:
            np.testing.assert_array_equal(before[key], after[key])
