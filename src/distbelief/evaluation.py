"""Held-out evaluation off the driver's hot loop: a budgeted cadence and an evaluator actor.

During a Downpour run an :data:`EvalActor` fetches the shards' current parameters itself
and scores a fixed seeded sample of the test set; the driver only submits to it and
collects its reply in the same ``ray.wait`` as the replicas' segments. :class:`EvalBudget`
says when the next evaluation may start: an evaluation that used ``c`` CPU seconds starts
the next one no sooner than ``c / budget`` seconds after it began, so evaluating takes at
most ``budget`` of the CPU time the job has (``budget`` = ``--eval-budget`` times the job's
cores, :func:`job_cores`), never before the last one finished and never sooner than
``min_period_s`` after it started. CPU time, not wall time: an evaluator that shares the
cores with busy replicas waits for them, and its wall time says more about them than
about what it costs them.

Where: an evaluation is only worth its own process when it costs something. Before the run
starts, :func:`probe_cost` times the model's forward pass on a few test rows in the driver
and scales it to the sample; below :data:`INLINE_EVAL_S` (the 5,000-parameter MLPs on
digits: well under a millisecond) the periodic evaluations run in the driver, on the same
budget, and no evaluator process is started (one process whose start-up, about a second and
a half of CPU to import torch, costs a short run more than all its evaluations); above it
(the CNN on MNIST: about 0.17 s; the 17M MLP: seconds) they run in the evaluator actor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import ray
import torch

from distbelief.allocator import keep_freed_memory
from distbelief.cluster import actor_options


def job_cores(actors: int, cluster_cpus: float, local_cpus: int | None) -> float:
    """The cores a job's ``actors`` (one CPU each) can keep busy: no more than the cluster's
    CPUs, nor, on an embedded Ray (``local_cpus``: this machine's cores), than this
    machine has (an embedded Ray may be told of more CPUs than there are cores)."""
    cores = min(float(actors), float(cluster_cpus))
    if local_cpus is not None:
        cores = min(cores, float(local_cpus))
    return max(1.0, cores)


class EvalBudget:
    """When the next evaluation is due (wall-clock seconds, ``time.time()``).

    ``budget``: the largest share of one core's time spent evaluating, in (0, inf) (a
    share above 1 lets evaluations run back to back); ``min_period_s``: the least time
    between two starts. The latest bound wins.
    """

    def __init__(self, budget: float, min_period_s: float, now: float) -> None:
        self.budget, self.min_period_s = budget, min_period_s
        self.at = now  # the first evaluation is due at once

    def due(self, now: float) -> bool:
        return now >= self.at

    def done(self, started: float, duration_s: float, cpu_s: float | None = None) -> None:
        """An evaluation started at ``started`` took ``duration_s`` seconds of wall time and
        ``cpu_s`` of CPU time (``None``: as much as wall time): set the next."""
        cpu_s = duration_s if cpu_s is None else cpu_s
        self.at = max(started + duration_s, started + cpu_s / self.budget,
                      started + self.min_period_s)


INLINE_EVAL_S = 0.01  # an evaluation estimated below this (CPU seconds) runs in the driver
PROBE_ROWS = 32


def probe_cost(evaluator, rows: int) -> float:
    """Estimated CPU seconds of one forward pass of ``evaluator``'s model over ``rows`` test
    rows: the fastest of three passes over its first :data:`PROBE_ROWS` (the first pays
    one-time costs), scaled. The driver's own thread's CPU time, so actors starting beside it
    do not inflate it, on one intra-op thread (with more, the calling thread spins at the
    pool's barrier while busy cores hold its helpers: measured 2 ms -> 117 ms for the digits
    MLP while a run's actors started). Scoring changes no state (``eval()`` mode,
    ``no_grad``); the thread count is restored."""
    probed = min(PROBE_ROWS, rows)
    best = float("inf")
    with one_thread():
        for _ in range(3):
            began = time.thread_time()
            evaluator.score(None, probed)
            best = min(best, time.thread_time() - began)
    return best * rows / max(1, probed)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread in this block (the count is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def score_now(evaluator, handles: list) -> dict:
    """Fetch from the shards with actor ``handles`` into ``evaluator`` and score it: the
    scores, the shard versions, when the fetch began (``t``, seconds since the epoch), the
    evaluation's wall time (``duration_s``) and CPU time of the calling thread (``cpu_s``).
    A dead shard raises ``RayActorError``."""
    began, cpu, t = time.perf_counter(), time.thread_time(), time.time()
    averaged = evaluator.average is not None
    versions = evaluator.load(handles, averaged)
    scores = {**evaluator.score(None), **evaluator.evaluated_field(averaged)}
    return {"t": t, "versions": versions, "scores": scores,
            "duration_s": time.perf_counter() - began, "cpu_s": time.thread_time() - cpu}


MIN_ROWS_PER_PASS = 64


def activation_bytes_per_row(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of every leaf module's output per row of ``x`` (a few rows) in one forward pass
    in ``eval()`` mode under ``no_grad`` (the mode is restored): what a pass writes."""
    total = 0

    def count(_module, _inputs, out) -> None:
        nonlocal total
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    return max(1, total // max(1, len(x)))


def rows_per_pass(param_bytes: int, act_bytes_per_row: int) -> int:
    """Test rows an evaluation puts through the model at a time: as many as make one pass's
    activations about as large as the weights, and at least :data:`MIN_ROWS_PER_PASS`.
    Each pass reads every weight once and writes its activations, so smaller passes of a
    model whose weights dwarf its activations re-read the weights (the 17M MLP: 68 MB of
    weights, 173 kB of activations a row -> 397 rows), and larger passes of one whose
    activations dwarf its weights leave the cache (the MNIST CNN: 1.8 MB of weights, about
    355 kB a row -> 64 rows). Measured on one thread over 1,000 rows: the CNN 0.59 CPU-s in
    one pass, 0.35 in passes of 64-128; the 17M MLP 0.46 in one pass, 0.43 in passes of
    256, 0.48 of 128 (and more under load, when memory bandwidth is shared)."""
    return max(MIN_ROWS_PER_PASS, param_bytes // act_bytes_per_row)


def score_passes(model: torch.nn.Module, loss_fn: torch.nn.Module,
                 parts: Iterator[tuple[torch.Tensor, torch.Tensor]], per_pass: int) -> dict:
    """Test loss (the mean over rows, so ``loss_fn`` must take the mean over a batch) and,
    for a classifier, accuracy (the exact share of rows right) of ``model`` over the test
    rows in ``parts`` (``(x, y)`` tensors), ``per_pass`` rows a forward pass, in ``eval()``
    mode under ``no_grad`` (the mode is restored)."""
    training = model.training
    model.eval()
    loss, correct, n, classifier = 0.0, 0, 0, True
    try:
        with torch.no_grad():
            for x, y in parts:
                for at in range(0, len(y), per_pass):
                    xb, yb = x[at:at + per_pass], y[at:at + per_pass]
                    out = model(xb)
                    loss += float(loss_fn(out, yb)) * len(yb)
                    n += len(yb)
                    classifier = classifier and out.ndim == 2 and not yb.is_floating_point()
                    if classifier:
                        correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(training)
    scores = {"test_loss": loss / max(1, n)}
    if classifier and n:
        scores["test_accuracy"] = correct / n
    return scores


def sample_rows(n: int, k: int, seed: int) -> np.ndarray:
    """A fixed seeded sample of ``min(n, k)`` of ``n`` test rows, in ascending order."""
    if k >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


class EvalWorker:
    """Scores the shards' current parameters with ``evaluator`` (an
    :class:`~distbelief.trainer.Evaluator` over the sampled test rows), one thread."""

    def __init__(self, evaluator) -> None:
        torch.set_num_threads(1)
        keep_freed_memory()
        self.evaluator = evaluator

    def evaluate(self, shards: list) -> dict:
        """:func:`score_now` against ``shards`` (the shards' current handles), its CPU time
        the whole process's (the actor does nothing else)."""
        cpu = time.process_time()
        return score_now(self.evaluator, shards) | {"cpu_s": time.process_time() - cpu}


EvalActor = ray.remote(EvalWorker)  # the evaluator actor; its methods are remote methods


class Evaluations:
    """The driver's side of periodic evaluations: submit one to the evaluator actor when
    :class:`EvalBudget` allows, collect its reply as an ``eval`` event. A cheap evaluation
    (:func:`probe_cost` below :data:`INLINE_EVAL_S`) runs in the driver on the same budget
    and sample, with no evaluator actor (:attr:`inline`); one that cannot run in an actor
    (``evaluator.in_actor`` false: sparse models) is called in the driver every
    ``eval_every_s`` as before.

    ``job`` is the run's :class:`~distbelief.job.Job`, ``shards`` its
    :class:`~distbelief.ps.group.ShardSet`, ``evaluator`` the driver's
    :class:`~distbelief.trainer.Evaluator`, ``cfg`` the run's config.
    """

    def __init__(self, job, shards, evaluator, cfg) -> None:
        self.job, self.shards, self.evaluator = job, shards, evaluator
        cores = job_cores(cfg.replicas * cfg.partitions + cfg.shards,
                          ray.cluster_resources().get("CPU", 1.0),
                          None if cfg.address else os.cpu_count())
        self.budget = EvalBudget(cfg.eval_budget * cores, cfg.eval_every_s, time.time())
        self.ref: ray.ObjectRef | None = None
        self.started = 0.0
        self.actor = None
        self.inline = None  # the driver's evaluator of the sample, when it evaluates inline
        if evaluator.in_actor:
            n_test = evaluator.test_rows()
            self.rows = sample_rows(n_test, cfg.eval_rows, cfg.seed)
            self.fields = {"subset": len(self.rows)} if len(self.rows) < n_test else {}
            if n_test and probe_cost(evaluator, len(self.rows)) < INLINE_EVAL_S:
                self.inline = evaluator.sampled(self.rows)
            else:
                self._start_actor()

    def _start_actor(self) -> None:
        self.actor = EvalActor.options(num_cpus=0, **actor_options()).remote(
            self.evaluator.sampled(self.rows))

    def where(self) -> str:
        """Where periodic evaluations run: ``actor`` or ``driver``."""
        return "actor" if self.actor is not None else "driver"

    def ready(self) -> None:
        """Submit the evaluation of the initial parameters and wait until the evaluator
        actor's process is up (its start-up, seconds on busy cores, would otherwise fall
        into the training); the evaluation runs as soon as the process is up. Its cost
        spaces the next as any other's, from when it was submitted, so the evaluator's
        start-up counts towards the spacing. Measured on the MNIST CNN (2 replicas, 2 shards,
        5% budget): the first evaluation of trained parameters came 10.5 s into the training
        when the initial one was submitted with the replicas' first steps and scored all
        1,000 rows at once, under 1 s in with this and :func:`rows_per_pass`
        (each evaluation 0.35-0.55 CPU-s instead of 0.95-1.05)."""
        up = None if self.actor is None else self.actor.__ray_ready__.remote()
        self.submit_if_due()  # an actor runs its calls in order: this one after start-up
        if up is not None:
            ray.get(up)

    def submit_if_due(self) -> None:
        """Start an evaluation if none is running and the budget allows one now."""
        now = time.time()
        if self.ref is not None or not self.budget.due(now):
            return
        if self.inline is not None:  # cheap: in the driver, on the budget; on one thread,
            # since more would spin on the cores the replicas are using
            with one_thread():
                reply = self.shards.retry(lambda: score_now(self.inline,
                                                            self.shards.handles()))
            self._log(reply, reply["t"])
            return
        if self.actor is None:  # in the driver; also notices a dead shard and revives it
            self.shards.retry(lambda: self.evaluator.evaluate(self.job, self.shards))
            self.budget.done(time.time(), 0.0)
            return
        self.started = now
        self.ref = self.actor.evaluate.remote(self.shards.handles())

    def wake(self) -> float:
        """When the driver should look again (the next start; ``inf`` while one runs)."""
        return float("inf") if self.ref is not None else self.budget.at

    def refs(self) -> list[ray.ObjectRef]:
        """The running evaluation's reply, to wait on with the replicas' segments."""
        return [] if self.ref is None else [self.ref]

    def collect(self, ref: ray.ObjectRef) -> bool:
        """Log the evaluation whose reply ``ref`` is ready; False if ``ref`` is not one.

        A failed one (a shard died under its fetch, or the evaluator died) revives the
        dead shard through the driver's probe, restarts a dead evaluator, and is retried
        ``eval_every_s`` after it started."""
        if self.ref is None or ref != self.ref:
            return False
        self.ref = None
        try:
            reply = ray.get(ref)
        except ray.exceptions.RayError as err:
            if not isinstance(err, ray.exceptions.RayTaskError):
                self._start_actor()  # the evaluator itself died
            self.shards.retry(self.shards.stats)
            self.budget.done(self.started, 0.0)
            return True
        self._log(reply, self.started)
        return True

    def _log(self, reply: dict, started: float) -> None:
        """Log a :func:`score_now` reply as an ``eval`` event; the next one is due as the
        budget says for one ``started`` then, by its CPU time (``cost_s`` in the event). Not
        by its fetch's wall time: that includes waiting, for shards still starting (4.2 s
        for the digits demo's first evaluation, which then spaced the next one 70 s out) or
        busy with pushes."""
        t, versions, scores = reply["t"], reply["versions"], reply["scores"]
        self.job.log("eval", t=t, updates=sum(versions), versions=versions,
                     elapsed_s=t - self.job.began, cost_s=round(reply["cpu_s"], 4),
                     **self.fields, **scores)
        self.job.evaluated(scores)
        self.budget.done(started, reply["duration_s"], reply["cpu_s"])

    def stop(self, collect: bool = False) -> None:
        """End the evaluator actor; with ``collect`` first wait for the running evaluation
        and log it (so even a run shorter than the actor's start has one), else forget it."""
        if collect and self.ref is not None:
            self.collect(self.ref)
        self.ref = None
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
