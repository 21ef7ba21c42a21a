"""A partition's Downpour protocol: fetch and push just its own parameters, step by step."""

from __future__ import annotations

import torch

from distbelief.modelpar.core import PartitionCore


class PartitionPushFetch(PartitionCore):
    """Fetch this partition's flat ranges every ``n_fetch`` steps, push the gradient accrued
    since the last push every ``n_push`` steps, apply its gradient locally in between."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.since_push = 0  # steps accrued since the last push
        self._prefetched: tuple | None = None  # a fetch in flight for the next fetching step

    def fetch(self) -> list[int]:
        """Overwrite this partition's parameters with the shards' values; returns versions.
        Waits for the fetch :meth:`prefetch` sent, if any, instead of sending one."""
        sent, self._prefetched = self._prefetched, None
        self._load(self.client.fetch_ranges_finish(sent) if sent is not None
                   else self.client.fetch_ranges(self.ranges))
        return list(self.client.versions)

    def prefetch(self) -> None:
        """Send the next fetch now, while the steps before it compute; called after the last
        push before that fetch, so it sees that push (a shard serves one caller's calls in
        order). :meth:`fetch` waits for it."""
        if self.client is not None:
            self._prefetched = self.client.fetch_ranges_start(self.ranges)

    def grad_sqnorm(self) -> float:
        """The squared L2 norm of this step's gradients of the owned slices (the partitions'
        slices are disjoint, so the model's squared norm is the sum over partitions)."""
        return float(sum(torch.sum(g.double() ** 2) for g in self.part.gradients().values()))

    def end_step(self, push: bool, local_lr: float | None, scale: float = 1.0) -> None:
        """Accrue this step's gradients (times ``scale``: ``--clip-grad-norm``); push them if
        ``push``; apply them locally with plain SGD at ``local_lr`` if given; clear them for
        the next step."""
        grads = self.part.gradients()
        if scale != 1.0:
            for g in grads.values():
                g.mul_(scale)
        if self.client is not None:  # without shards (benchmarks, tests) nothing is pushed
            self._add_grads(self.accrued)
            self.since_push += 1
            if push:
                self._push()
        if local_lr is not None:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.add_(grads[name], alpha=-local_lr)
        self.part.zero_grad()

    def _push(self) -> None:
        self.client.push_ranges(self.ranges, self.accrued)  # Ray copies it at submission
        self.accrued[:] = 0.0
        self.since_push = 0

    def finish(self) -> dict:
        """Push what is still accrued and wait until the shards applied it."""
        if self.since_push:
            self._push()
        if self.client is not None:
            self.client.wait()
        return self.counters()

    def counters(self) -> dict:
        c = self.client
        return {"bytes_sent": self.bytes_sent, "messages_sent": self.messages_sent,
                "rejected": c.rejected if c else 0, "pushes": c.pushes if c else 0}
