"""The flat dense parameter host: a whole model as one flat buffer, fetched and pushed whole.

A :class:`FlatHost` keeps a :class:`~distbelief.flat.FlatModel` (parameters and gradients
in two flat float32 buffers laid out by the :class:`ShardPlan`) and talks to every shard
through one :class:`PSClient`. It implements :class:`~distbelief.host.ParamHost`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from distbelief.devices import DeviceBuffers, autocast, replica_device
from distbelief.flat import FlatModel
from distbelief.host import GradClip, LossOf
from distbelief.ps.buffers import BufferPlan, BufferReporter
from distbelief.ps.client import PSClient
from distbelief.ps.plan import ShardPlan


class FlatHost:
    """``model``'s trainable parameters in one buffer, sliced over ``shards`` by ``plan``.

    ``names`` (the shards' actor names) let the client survive a shard's restart, and with
    ``resend`` and ``directory`` a failover to a standby (see :class:`PSClient`, which
    also takes ``incarnation``);
    ``grad_dtype`` is the pushed gradients' wire format; with ``fuse`` a push whose next
    step fetches (of a gradient of any size) also brings the parameters back in the same
    call per shard. ``device`` (cpu, cuda, auto: see
    :func:`~distbelief.devices.replica_device`) is where the model and gradients live, and
    ``precision`` what its forward computes in (:func:`~distbelief.devices.autocast`); off
    CPU (or with ``staged``, which tests use on CPU), parameters and gradients pass through
    reusable host buffers (:class:`DeviceBuffers`). A model with buffers (BatchNorm
    statistics) reports them to shard 0 with each push and loads shard 0's with each fetch
    (:mod:`distbelief.ps.buffers`); without buffers the calls are exactly as before.
    With ``sync`` (``--backup-workers``, :mod:`distbelief.ps.sync`: the run's last version,
    None for asynchronous runs) a push is waited for and never fused with the fetch, and the
    next fetch first waits until every shard that took the push before that last version
    has moved past it (a shard at the end takes no more updates: nothing to wait for there;
    ``sync_waits`` counts the wait calls that timed out). With ``clip`` > 0
    (``--clip-grad-norm``) each step's gradient is scaled down to L2 norm ``clip`` before it
    is pushed, accrued or applied locally; each step event gets the norm before
    (``grad_norm``) and the counters how many steps were scaled (``clipped``).
    """

    event_fields: dict = {}

    def __init__(self, model: nn.Module, plan: ShardPlan, shards: list, replica: int = -1,
                 names: Sequence[str] | None = None, grad_dtype: str = "float32",
                 fuse: bool = True, device: str = "cpu", staged: bool | None = None,
                 incarnation: int = 0, resend: bool = False,
                 directory: str | None = None, sync: int | None = None,
                 precision: str = "float32", clip: float = 0.0) -> None:
        self.device, self.precision = replica_device(device), precision
        self.flat = FlatModel(model, plan, self.device)
        if staged is None:
            staged = self.device.type != "cpu"
        self.staging = DeviceBuffers(self.flat.flat) if staged else None
        buffers = BufferPlan.of(model)
        self.buffers = BufferReporter(buffers, self.flat.model) if buffers else None
        self._params_np = self.flat.flat_np if self.staging is None else self.staging.params_np
        self.client = PSClient(shards, plan, replica=replica, names=names,
                               grad_dtype=grad_dtype, incarnation=incarnation, resend=resend,
                               directory=directory)
        self.plan, self.fuse, self.replica = plan, fuse and sync is None, replica
        self.sync, self.sync_waits = sync, 0
        self.clipping = GradClip(clip)
        self._pushed: list[int | None] | None = None  # sync: versions the last push was of
        self.accrued: torch.Tensor | None = None  # created once a step ends without a push
        self._fetched_early = False
        self._prefetched: list | None = None  # a fetch in flight for the next fetching step
        self.pending: dict[int, torch.Tensor] = {}  # Sandblaster portions awaiting a verdict
        self.batch_sum = torch.zeros(0)  # Sandblaster: the kept portions' gradient sum

    # Downpour

    def fetch(self, upcoming: Callable[[], np.ndarray] | None = None) -> dict:
        if self._pushed is not None:  # sync: the update of the version pushed comes first
            self.sync_waits += self.client.wait_newer(
                [v if v is not None and v < self.sync else None for v in self._pushed])
            self._pushed = None
        if self._fetched_early:  # the last push brought this step's parameters back
            self._fetched_early = False
        elif self._prefetched is not None:  # sent after the last push before this step
            refs, self._prefetched = self._prefetched, None
            self.client.fetch_finish(refs, self._params_np)
        else:
            self.client.fetch_into(self._params_np, buffers=self.buffers is not None)
            self._load_buffers()
        if self.staging is not None:
            self.staging.params_to_device()
        return {}

    def _load_buffers(self) -> None:
        if self.buffers is not None:
            self.buffers.load(self.client.buffers)

    def prefetch(self, upcoming: Callable[[], np.ndarray] | None = None) -> None:
        """Send the next fetch now, while the steps before it compute; the loop calls it
        right after the last push before that fetch, so it sees every push this replica
        sent (a shard serves one caller's calls in order). :meth:`fetch` waits for it.
        ``upcoming`` (the inputs of the batches from that fetch on) is not needed here."""
        if self.buffers is None:  # a model with buffers fetches them with its parameters
            self._prefetched = self.client.fetch_start()

    def forward_backward(self, x: torch.Tensor, loss_of: LossOf) -> float:
        self.flat.zero_grad()
        with autocast(self.device, self.precision):
            loss = loss_of(self.flat.model(x))
        loss.backward()
        self.flat.sync_grads()
        if self.clipping.clip:
            self._clip()
        if self.accrued is not None:
            self.accrued += self.flat.grad
        return float(loss.detach())

    def _clip(self) -> None:
        """Scale the step's gradient down to the bar (:func:`~distbelief.host.clip_scale`)."""
        scale = self.clipping.scale(float(torch.linalg.vector_norm(self.flat.grad)))
        if scale != 1.0:
            self.flat.grad.mul_(scale)

    def end_step(self, push: bool, local_lr: float | None, fetch_next: bool) -> None:
        if push:
            self.push(fetch_next)
        else:
            self._accrue()
        if local_lr is not None:
            self.apply_local(local_lr)

    def _accrue(self) -> None:
        """Start summing step gradients at the first step that ends without a push (``n_push``
        > 1); later steps add theirs in :meth:`forward_backward`."""
        if self.accrued is None:
            self.accrued = torch.zeros_like(self.flat.grad)
            self.accrued += self.flat.grad

    def push(self, fetch_next: bool = False) -> None:
        """Push the accrued gradient (the step's, if nothing accrued). Fused with the next
        fetch (see :meth:`PSClient.push_fetch_into`) where ``fetch_next``; otherwise it
        overlaps the next step."""
        grad = self.accrued if self.accrued is not None else self.flat.grad
        report = None if self.buffers is None else self.buffers.report()
        if self.fuse and fetch_next:
            self.client.push_fetch_into(self._host_np(grad), self._params_np, buffers=report)
            self._load_buffers()
            self._fetched_early = True
        elif self.sync is not None:
            self._pushed = self.client.push_sync(self._host_np(grad), buffers=report)
        else:
            self.client.push(self._host_np(grad), buffers=report)
        if self.accrued is not None:
            self.accrued.zero_()

    def _host_np(self, t: torch.Tensor) -> np.ndarray:
        """``t`` (flat, float32) as NumPy on the host: a view on CPU, else the host buffer."""
        return t.numpy() if self.staging is None else self.staging.grad_to_host(t)

    def apply_local(self, lr: float) -> None:
        """Plain SGD at ``lr`` with this step's gradient."""
        with torch.no_grad():
            self.flat.flat.add_(self.flat.grad, alpha=-lr)

    def versions(self) -> list[int]:
        return list(self.client.versions)

    def after_run(self, events: list[dict]) -> dict:
        self.clipping.annotate(events)
        return self.counters()

    def finish(self, push: bool, fetch_next: bool = False) -> dict:
        if push:
            self.push(fetch_next)
        self.client.wait()
        return self.counters()

    def counters(self) -> dict:
        c = self.client
        return {"fetches": c.fetches, "pushes": c.pushes, "rejected": c.rejected,
                "push_dropped": c.dropped, "dropped_by_shard": list(c.dropped_by_shard),
                "retried": c.retried, "incarnation": c.incarnation, "resent": c.resent,
                **({"sync_waits": self.sync_waits} if self.sync is not None else {}),
                **self.clipping.counters(),
                **self._device_field()}

    def _device_field(self) -> dict:
        """``{"device": "cuda:0"}`` off CPU (nothing on CPU, so CPU counters are unchanged)."""
        return {} if self.staging is None else {"device": str(self.device)}

    def partitions(self) -> list:
        return []

    # Sandblaster

    def load_vector(self, name: str) -> None:
        self.client.fetch_vector_into(name, self._params_np)
        if self.staging is not None:
            self.staging.params_to_device()
        self.pending = {}
        self.batch_sum = torch.zeros_like(self.flat.grad)

    def hold(self, portion: int) -> None:
        self.pending[portion] = self.flat.grad.clone()

    def settle(self, verdicts: list[tuple[int, bool]]) -> None:
        for portion, keep in verdicts:
            grad = self.pending.pop(portion, None)
            if grad is not None and keep:
                self.batch_sum += grad

    def stage(self, tag: str) -> bool:
        if not self.client.stage(tag, self._host_np(self.batch_sum)):
            return False
        self.batch_sum.zero_()
        return True

    def discard(self) -> None:
        self.pending = {}
        self.batch_sum.zero_()
