"""The driver's pure parts, without Ray: the run (Job), checkpoint writing through a shard
set, cadences, the Downpour segment schedule and the rejection messages."""

import json

import numpy as np

from distbelief.checkpoint import load_row_shard, load_shard, read_manifest, shard_file
from distbelief.checkpointer import Checkpointer
from distbelief.job import Cadence, Job, actor_name, node_for
from distbelief.ps.group import ShardSet, rejection_error
from distbelief.ps.optim import Adagrad
from distbelief.ps.plan import ShardPlan
from distbelief.ps.shard import ShardCore
from distbelief.segments import WorkPool
from distbelief.sparse.group import row_rejection_error


class CoreShards(ShardSet):
    """Two in-process shard cores standing in for shard actors (no revival)."""

    def __init__(self, plan: ShardPlan) -> None:
        super().__init__(revives=False)
        self.cores = [ShardCore(i, np.full(hi - lo, float(i), np.float32), Adagrad(0.1))
                      for i, (lo, hi) in enumerate(zip(plan.bounds, plan.bounds[1:]))]
        self.saved_as: list[int] = []

    def save(self, run_dir, number, vectors=()):
        versions = [c.save(str(shard_file(run_dir, number, i)), vectors)
                    for i, c in enumerate(self.cores)]
        return versions, {"note": "extra from the shards"}

    def saved(self, run_dir, number):
        self.saved_as.append(number)


def test_job_numbers_checkpoints_and_writes_a_manifest_the_shards_restore_from(tmp_path):
    plan = ShardPlan.build([("w", (3, 2)), ("b", (2,))], 2)
    job = Job("abcd1234", "downpour", tmp_path / "run", checkpoint=0)
    shards = CoreShards(plan)
    shards.cores[1].push(np.ones(4, np.float32), 0)
    every = Checkpointer(job, shards, plan, ["accumulator"], every_s=float("inf"))
    assert not every.due()
    assert every.write({"algorithm": "downpour"}) == 1
    assert every.write({"algorithm": "downpour"}) == 2
    assert job.checkpoints == 2 and shards.saved_as == [1, 2]
    manifest = read_manifest(tmp_path / "run", 2)
    assert manifest["algorithm"] == "downpour" and manifest["note"] == "extra from the shards"
    assert [e["version"] for e in manifest["shards"]] == [0, 1]
    part = load_shard(tmp_path / "run", 2, 1, plan, ["accumulator"])
    again = ShardCore(1, np.zeros(4, np.float32), Adagrad(0.1))
    again.restore(part["arrays"], part["version"], part["counters"])
    assert again.stats() == shards.cores[1].stats()
    logged = [e for e in job.events if e["event"] == "checkpoint"]
    assert [e["number"] for e in logged] == [1, 2] and logged[1]["versions"] == [0, 1]
    job.close()


def test_a_job_without_a_folder_keeps_events_and_writes_no_checkpoint():
    plan = ShardPlan.build([("w", (4,))], 1)
    job = Job("abcd1234", "sandblaster", None, checkpoint=3)
    shards = CoreShards(plan)
    assert Checkpointer(job, shards, plan, [], every_s=0.0).write({}) is None
    assert job.checkpoints == 3 and shards.saved_as == []
    job.evaluated({"test_accuracy": 0.5})
    job.evaluated({"test_loss": 1.0})
    assert job.accuracy == 0.5
    params = {"w": np.arange(4, dtype=np.float32)}
    result = job.finish(params, {"test_loss": 0.25}, updates=7, shard_stats=[], counters={})
    assert (result.test_loss, result.test_accuracy, result.updates) == (0.25, None, 7)
    assert result.run_dir is None and [e["event"] for e in result.events] == ["final"]
    assert actor_name("abcd1234", "rowshard", 2) == "distbelief-abcd1234-rowshard-2"


def test_job_writes_params_and_plot_at_the_end(tmp_path):
    job = Job("abcd1234", "downpour", tmp_path, checkpoint=0)
    job.log("step", replica=0, step=0, loss=1.0)
    job.finish({"w": np.ones(2, np.float32)}, {}, updates=1, shard_stats=[], counters={})
    assert (tmp_path / "params.safetensors").is_file() and (tmp_path / "plot.png").is_file()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["step", "final"]


def test_cadence_is_due_now_or_after_its_period():
    assert Cadence(60.0, due_now=True).due()
    later = Cadence(60.0)
    assert not later.due()
    later.restart()
    assert not later.due()
    never = Cadence(float("inf"))
    never.restart()
    assert not never.due() and never.at == float("inf")
    assert Cadence(0.0).due()


def test_work_pool_warm_starts_replica_zero_alone_then_runs_every_replica():
    p = WorkPool.from_done(3, 25, {}, segment_steps=10, warmstart_steps=12)
    p.assign([0, 1, 2])
    assert p.warm and p.next(1) is None and p.next(2) is None
    assert p.next(0) == (0, 0, 10)
    p.done(0)
    assert p.next(0) == (0, 10, 12) and p.next(1) is None
    p.done(0)
    assert not p.warm
    assert [p.next(i) for i in (0, 1, 2)] == [(0, 12, 22), (1, 0, 10), (2, 0, 10)]
    p.done(1)
    assert p.next(1) == (1, 10, 20)
    p.done(1)
    assert p.next(1) == (1, 20, 25)
    p.done(1)
    assert p.replica_steps() == {"0": 12, "1": 25, "2": 0}  # running segments are unrun


def test_work_pool_of_a_resumed_run_skips_a_finished_warm_start():
    p = WorkPool.from_done(2, 30, {0: 14, 1: 30}, segment_steps=10, warmstart_steps=10)
    p.assign([0, 1])
    assert not p.warm
    assert p.next(0) == (0, 14, 24) and p.next(1) is None


def test_rejection_errors_name_the_flag_and_the_fix():
    dense = [{"rejected_total": 2, "rejected": {"nonfinite": 2}},
             {"rejected_total": 1, "rejected": {"shape": 1}}]
    assert rejection_error(dense, 3) is None
    message = rejection_error(dense, 2)
    assert "rejected 3 pushes" in message and "--max-rejected 2" in message
    assert "nonfinite" in message and "\n" not in message
    rows = [{"rejected_total": 0, "last_rejection": None},
            {"rejected_total": 4, "last_rejection": "row 9 is out of range"}]
    assert row_rejection_error(rows, 4) is None
    message = row_rejection_error(rows, 3)
    assert "embedding shards rejected 4" in message and "row 9 is out of range" in message


def test_row_shard_restore_point_is_read_from_the_manifest(tmp_path):
    from safetensors.numpy import save_file

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    save_file({"t/rows": np.arange(3)}, str(folder / "000004-rowshard1.safetensors"))
    (folder / "checkpoint-000004.json").write_text(json.dumps({"row_shards": [
        {"file": "000004-rowshard0.safetensors", "version": 2},
        {"file": "000004-rowshard1.safetensors", "version": 5}]}))
    part = load_row_shard(tmp_path, 4, 1)
    assert part["version"] == 5
    np.testing.assert_array_equal(part["arrays"]["t/rows"], np.arange(3))


def test_actors_are_placed_round_robin_over_the_sorted_live_nodes():
    nodes = ["b", "a", "c"]
    assert [node_for(nodes, i) for i in range(5)] == ["a", "b", "c", "a", "b"]
    assert node_for(["b", "c"], 0) == "b"  # node a left: replica 0 moves on
    # standby k (counted from 1) of shard k - 1 is never on its primary's node
    assert all(node_for(nodes, k + 1) != node_for(nodes, k)
               for k in range(3))
    assert node_for(["a"], 3) is None  # one node: Ray's choice
    assert node_for([], 0) is None
