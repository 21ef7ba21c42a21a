"""The run's checkpoint writer: every shard saves its files, then the manifest is written."""

from __future__ import annotations

from collections.abc import Sequence

from distbelief import storage
from distbelief.checkpoint import write_manifest
from distbelief.job import Cadence, Job
from distbelief.ps.group import ShardSet
from distbelief.ps.plan import ShardPlan


class Checkpointer:
    """Writes the run's numbered checkpoints: every shard its files, then the manifest.

    ``plan`` and ``state_names`` (the update rule's state arrays) describe the dense shards'
    files in the manifest; a checkpoint is due every ``every_s`` seconds.
    """

    def __init__(self, job: Job, shards: ShardSet, plan: ShardPlan,
                 state_names: Sequence[str], every_s: float) -> None:
        self.job = job
        self.shards = shards
        self.plan = plan
        self.state_names = tuple(state_names)
        self.cadence = Cadence(every_s)

    def due(self) -> bool:
        return self.cadence.due()

    def write(self, extra: dict, vectors: tuple[str, ...] = ()) -> int | None:
        """Checkpoint the shards (with the named Sandblaster ``vectors``) and the manifest
        fields ``extra``; the checkpoint's number (None: the run has no folder).

        The manifest is written last, so a crash leaves the previous checkpoint the newest;
        then shards that die restart from this one.
        """
        number = self.job.next_checkpoint()
        if number is not None:
            self._write(number, extra, vectors)
        self.cadence.restart()
        return number

    def _write(self, number: int, extra: dict, vectors: tuple[str, ...]) -> None:
        run_dir = self.job.store  # the run folder, or its URL: the shards write there
        storage.makedirs(storage.join(run_dir, "checkpoints"))
        versions, fields = self.shards.save(run_dir, number, vectors)
        extra = {**extra, **fields}
        write_manifest(run_dir, number, versions, self.plan, self.state_names, extra)
        self.job.checkpoints = number
        self.shards.saved(run_dir, number)
        self.job.log("checkpoint", number=number, versions=versions, **extra)
        self.job.mirror()
