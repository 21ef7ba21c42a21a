"""Model buffers (BatchNorm running statistics and the like) kept on shard 0 (pure).

A model's persistent buffers are of two kinds. **Statistics** (every floating buffer:
``running_mean``, ``running_var``, ...) travel as one float32 vector; a replica reports its
current values with each push and shard 0 keeps a running average of the reports,
``b <- b + (r - b) / R`` for ``R`` replicas: with one replica the shard holds exactly that
replica's buffers (as single-process training would), with ``R`` it is an exponential
average over about the last ``R`` reports, one per replica, so no replica's batches win and
the average cannot overshoot (summing deltas would multiply BatchNorm's momentum by ``R``).
**Counts** (integer buffers: ``num_batches_tracked``) travel as int64 and are summed: a
replica reports how much each grew since it last reported or loaded them, so the shard
counts every batch of every replica. Replicas load both on fetch. Other buffers (bool) stay
as the model made them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

Report = tuple[np.ndarray, np.ndarray]  # (statistics float32 (n_float,), count deltas int64)


@dataclass(frozen=True)
class BufferPlan:
    """Which buffers of a model travel, by name and shape, in ``named_buffers()`` order."""

    floats: tuple[tuple[str, tuple[int, ...]], ...]
    counts: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, model: nn.Module) -> BufferPlan:
        persistent = set(model.state_dict().keys())
        floats, counts = [], []
        for name, b in model.named_buffers():
            if name not in persistent:
                continue
            if b.is_floating_point():
                floats.append((name, tuple(b.shape)))
            elif b.dtype != torch.bool and not b.is_complex():
                counts.append((name, tuple(b.shape)))
        return cls(tuple(floats), tuple(counts))

    def __bool__(self) -> bool:
        return bool(self.floats or self.counts)

    @property
    def n_float(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for _, s in self.floats)

    @property
    def n_count(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for _, s in self.counts)

    def read(self, model: nn.Module) -> Report:
        """The model's current statistics (float32) and counts (int64), as flat copies."""
        buffers = dict(model.named_buffers())
        return (_gather(buffers, self.floats, np.float32),
                _gather(buffers, self.counts, np.int64))

    def write(self, model: nn.Module, floats: np.ndarray, counts: np.ndarray) -> None:
        """Load flat statistics and counts into the model's buffers (in place, any dtype)."""
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for specs, flat in ((self.floats, floats), (self.counts, counts)):
                offset = 0
                for name, shape in specs:
                    k = int(np.prod(shape, dtype=np.int64))
                    b = buffers[name]
                    b.copy_(torch.from_numpy(np.array(flat[offset: offset + k])).view(shape))
                    offset += k

    def named(self, model: nn.Module) -> dict[str, np.ndarray]:
        """Copies of the travelling buffers by name, in their own dtypes and shapes."""
        buffers = dict(model.named_buffers())
        return {name: buffers[name].detach().cpu().numpy().copy()
                for name, _ in (*self.floats, *self.counts)}


def _gather(buffers: dict[str, torch.Tensor], specs, dtype) -> np.ndarray:
    if not specs:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([buffers[n].detach().reshape(-1).cpu().numpy().astype(dtype)
                           for n, _ in specs])


class BufferReporter:
    """A replica's side: what to report with a push, what to load on a fetch.

    Counts are reported as deltas since the last report or load, so a shard can sum them.
    """

    def __init__(self, plan: BufferPlan, model: nn.Module) -> None:
        self.plan, self.model = plan, model
        self._counts_seen = plan.read(model)[1]

    def report(self) -> Report:
        floats, counts = self.plan.read(self.model)
        delta = counts - self._counts_seen
        self._counts_seen = counts
        return floats, delta

    def load(self, served: Report | None) -> None:
        if served is None:
            return
        floats, counts = served
        self.plan.write(self.model, floats, counts)
        self._counts_seen = np.array(counts, dtype=np.int64)


class BufferAverage:
    """Shard 0's buffers: the running average of the replicas' statistics and the sum of
    their count deltas (see the module docstring); ``replicas`` is ``R``."""

    def __init__(self, floats: np.ndarray, counts: np.ndarray, replicas: int) -> None:
        self.floats = np.array(floats, dtype=np.float32, copy=True).reshape(-1)
        self.counts = np.array(counts, dtype=np.int64, copy=True).reshape(-1)
        self.weight = np.float32(1.0 / max(1, int(replicas)))
        self.reports = 0

    def __setstate__(self, state: dict) -> None:
        """Unpickled (in a shard actor) with arrays of its own: Ray's are read-only."""
        self.__dict__.update(state)
        self.floats, self.counts = self.floats.copy(), self.counts.copy()

    def check(self, report: object) -> bool:
        """Whether ``report`` is a well-formed ``(floats, count deltas)`` pair."""
        if not (isinstance(report, tuple) and len(report) == 2):
            return False
        floats, counts = report
        return (isinstance(floats, np.ndarray) and floats.dtype == np.float32
                and floats.shape == self.floats.shape and bool(np.isfinite(floats).all())
                and isinstance(counts, np.ndarray) and counts.dtype == np.int64
                and counts.shape == self.counts.shape)

    def report(self, floats: np.ndarray, count_deltas: np.ndarray) -> None:
        """Fold one replica's report in: ``b += (r - b) / R``; counts += deltas."""
        self.floats += (floats - self.floats) * self.weight
        self.counts += count_deltas
        self.reports += 1

    def served(self) -> Report:
        return self.floats.copy(), self.counts.copy()

    def arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint holds (the shard file's ``buffers``, ``buffer_counts``)."""
        return {"buffers": self.floats, "buffer_counts": self.counts}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Load :meth:`arrays` from a checkpoint; one without buffers leaves them as they are."""
        if "buffers" in arrays and arrays["buffers"].shape == self.floats.shape:
            np.copyto(self.floats, arrays["buffers"])
        if "buffer_counts" in arrays and arrays["buffer_counts"].shape == self.counts.shape:
            np.copyto(self.counts, arrays["buffer_counts"])
