import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import UserError
from distbelief.ps.plan import ShardPlan

shapes = st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, shards=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_split_then_assemble_is_identity(shapes, shards, seed):
    rng = np.random.default_rng(seed)
    arrays = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    total = sum(a.size for a in arrays.values())
    if shards > total:
        with pytest.raises(UserError, match="--shards"):
            ShardPlan.for_arrays(arrays, shards)
        return
    plan = ShardPlan.for_arrays(arrays, shards)
    parts = plan.split(arrays)
    assert [p.size for p in parts] == [plan.shard_size(i) for i in range(shards)]
    assert all(p.size >= 1 for p in parts)
    back = plan.assemble(parts)
    assert list(back) == list(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(back[name], value)
    # pieces cover every element exactly once
    covered = sum(piece.length for i in range(shards) for piece in plan.pieces(i))
    assert covered == total


def test_large_tensor_is_cut_and_shards_balanced():
    arrays = {"w": np.zeros((1000, 100), np.float32), "b": np.zeros(100, np.float32)}
    plan = ShardPlan.for_arrays(arrays, 4)
    sizes = [plan.shard_size(i) for i in range(4)]
    ideal = plan.numel / 4
    assert max(sizes) <= 1.1 * ideal
    assert len(plan.pieces(0)) == 1 and plan.pieces(0)[0].name == "w"


def test_small_tensors_stay_whole_when_a_boundary_is_near():
    # 4 tensors of 100 elements and 2 shards: the cut falls exactly between tensors.
    arrays = {f"t{i}": np.zeros(100, np.float32) for i in range(4)}
    plan = ShardPlan.for_arrays(arrays, 2)
    assert plan.bounds == (0, 200, 400)
    arrays = {"a": np.zeros(95, np.float32), "b": np.zeros(105, np.float32)}
    plan = ShardPlan.for_arrays(arrays, 2)
    assert plan.bounds == (0, 95, 200)  # snapped 5 elements to keep both tensors whole


def test_more_shards_than_elements_is_a_user_error():
    with pytest.raises(UserError, match="--shards 5 exceeds the model's 3 parameter elements"):
        ShardPlan.build([("w", (3,))], 5)


def test_flatten_rejects_wrong_shape():
    plan = ShardPlan.build([("w", (2, 3))], 1)
    with pytest.raises(UserError, match="shape"):
        plan.flatten({"w": np.zeros((3, 2), np.float32)})
