"""The parameter host: how a replica holds, fetches, computes with and pushes its parameters.

A replica (:mod:`distbelief.replica` for Downpour, :mod:`distbelief.sandblaster.replica`
for Sandblaster) is one loop over a :class:`ParamHost`; the loop owns the data rows, the
schedule and the events, the host owns the parameters. There is one host per kind of
parameters: :class:`~distbelief.ps.host.FlatHost` (dense, one flat buffer),
:class:`~distbelief.modelpar.host.PartitionedHost` (a group of partition actors) and
:class:`~distbelief.sparse.host.RowSparseHost` (dense plus embedding rows fetched by id).

A driver hands a replica a :data:`HostFactory`, e.g. ``functools.partial(FlatHost, model,
plan, shards)``; the replica calls it as ``factory(replica=index)`` in its own process, so
whatever the host starts (partition actors) is the replica's and dies with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

LossOf = Callable[[torch.Tensor], torch.Tensor]  # the model's output -> a scalar loss


class ParamHost(Protocol):
    """One replica's parameters. Shapes: ``x`` is a batch of inputs ``(N, *input)``;
    gradients and parameters never leave the host except to the shards."""

    event_fields: dict
    """Extra fields of a step event whose step did not fetch (a fetch returns its own)."""

    # Downpour: fetch every n_fetch steps, compute every step, push every n_push steps.

    def fetch(self, upcoming: Callable[[], np.ndarray]) -> dict:
        """Start (or do) a fetch of fresh parameters, ready before the next forward pass.
        ``upcoming()`` gives the inputs of the batches until the next fetch, for a host that
        fetches only what they use. Returns extra fields for this step's event.

        A host may also offer ``prefetch(upcoming)``: send the next fetch early, right after
        the last push before it (``upcoming()``: that fetch's batches' inputs), for
        :meth:`fetch` to wait for (every host here does)."""

    def forward_backward(self, x: torch.Tensor, loss_of: LossOf) -> float:
        """Forward ``x``, ``loss_of(output)``, backward; the step's gradient is kept (and
        accrued for the next push). Returns the loss."""

    def end_step(self, push: bool, local_lr: float | None, fetch_next: bool) -> None:
        """End a step: push the gradient accrued since the last push if ``push``, apply the
        step's gradient locally with plain SGD at ``local_lr`` if given. ``fetch_next`` says
        the next step fetches (a host may fetch together with the push)."""

    def versions(self) -> list[int]:
        """The shard versions of the parameters last fetched, one per shard."""

    def after_run(self, events: list[dict]) -> dict:
        """This host's counters after a run of steps; a host may add fields to ``events``."""

    def finish(self, push: bool, fetch_next: bool) -> dict:
        """Push what is still accrued if ``push`` (as :meth:`end_step` would), wait until the
        shards applied every push; the counters."""

    def counters(self) -> dict:
        """Fetches, pushes, rejections and whatever else this kind of host counts."""

    def partitions(self) -> list:
        """The actors this host runs for the replica (partition actors; else none)."""

    # Sandblaster: per batch fetch a named vector once, hold each portion's gradient until
    # the coordinator's verdict, stage the sum of the accepted ones under a tag.

    def load_vector(self, name: str) -> None:
        """Load Sandblaster vector ``name`` as the parameters; start a new batch (nothing
        held or accrued)."""

    def hold(self, portion: int) -> None:
        """Keep the gradient just computed as ``portion``'s until its verdict."""

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        """Add the kept portions' gradients to the batch's sum, forget the dropped ones
        (``verdicts`` are ``(portion, keep)`` for portions held here)."""

    def stage(self, tag: str) -> bool:
        """Add the batch's sum into what the shards stage under ``tag`` and empty it;
        False if a shard rejected it."""

    def discard(self) -> None:
        """Forget every held portion and the batch's sum."""


HostFactory = Callable[..., ParamHost]  # called as factory(replica=index) in the replica


def clip_scale(norm: float, clip: float) -> float:
    """What ``--clip-grad-norm clip`` multiplies a step's gradient of L2 norm ``norm`` by:
    ``clip / norm`` above the bar, else 1 (also for a non-finite norm, left for the shards
    to reject and count)."""
    return clip / norm if math.isfinite(norm) and norm > clip else 1.0


class GradClip:
    """A host's ``--clip-grad-norm`` bookkeeping (``clip`` 0: off): the norms of the steps
    of the current run and how many steps were scaled."""

    def __init__(self, clip: float) -> None:
        self.clip, self.clipped, self.norms = clip, 0, []

    def scale(self, norm: float) -> float:
        """Record a step's gradient norm; returns what its gradient is multiplied by."""
        self.norms.append(norm)
        scale = clip_scale(norm, self.clip)
        self.clipped += scale != 1.0
        return scale

    def annotate(self, events: list[dict]) -> None:
        """Give the run's step events their norms (``grad_norm``) and start the next run."""
        for event, norm in zip(reversed(events), reversed(self.norms)):
            event["grad_norm"] = norm
        self.norms = []

    def counters(self) -> dict:
        return {"clipped": self.clipped} if self.clip else {}
