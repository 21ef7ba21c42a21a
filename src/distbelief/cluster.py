"""The Ray connection: an embedded local instance by default, a real cluster with an address.

The embedded instance listens on loopback only, with Ray's default token authentication
(a token in ``~/.ray/auth_token``, made on first use), so a training job opens no port to
the network. With
``address`` (``--address`` / ``RAY_ADDRESS``) the same code joins an existing cluster.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import ray
import ray._private.ray_constants as ray_constants

from distbelief.errors import UserError

# Ray's own switch for "no multi-machine cluster": with it off, every Ray listener binds to
# 127.0.0.1 instead of all interfaces (measured with `ss -ltn`; see DESIGN.md).
_LOOPBACK_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR

# Ray sends a call's arguments and result inside the call and its reply up to this size,
# through the object store above it (Ray's default: 100 KiB). A CNN shard's ~1 MB gradient
# part and fetch reply cost the machine less inline: no object to create, seal, pin and free
# in the store (BENCHMARKS.md, 2026-12-07: the CNN's Downpour samples/s, raylet CPU). Above
# a few MB the object store is cheaper again (one copy in, zero-copy reads). Embedded
# sessions set it for every process; a cluster joined with ``--address`` keeps its own
# setting (``ray start --system-config='{"max_direct_call_object_size": 1048576}'``).
INLINE_BYTES = 1 << 20
INLINE_ENV = "DISTBELIEF_INLINE_BYTES"  # set it to measure other sizes


# Ray records an event for every task, for its dashboard and `ray list tasks`, and a caller
# holds each call's task spec, inline arguments included, until its events are reported
# (about every second). Measured 2026-12-07 (BENCHMARKS.md, "Ray's task events"): a client
# sending the CNN's push+fetch (two 0.9 MB calls) back to back grew to 1.4 GB against 330 MB
# without them, took 250-370 page faults a call while it grew, and spent 3.4 ms of CPU a call
# against 1.9 ms; a CNN replica, at one such call per 40 ms step, peaked at 460 MB against
# 400 MB (its samples/s did not change). Every actor of ours is created with
# :func:`actor_options`, which turn them off for its calls, as Ray Serve does for its own
# actors; ``DISTBELIEF_TASK_EVENTS=1`` in the environment of the process that creates an
# actor (the driver; a replica for its partitions, which inherits the driver's environment
# in an embedded session) turns them back on, to see the tasks in Ray's tools or to measure
# what they cost.
TASK_EVENTS_ENV = "DISTBELIEF_TASK_EVENTS"


def actor_options() -> dict:
    """Ray options every actor of ours is created with: Ray's task events off, unless
    ``DISTBELIEF_TASK_EVENTS=1`` (read at each call). Another value is a :class:`UserError`."""
    value = os.environ.get(TASK_EVENTS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise UserError(f"{TASK_EVENTS_ENV}={value!r}: set it to 1 (Ray's task events on, "
                        "as in Ray's tools) or 0, or unset it")
    return {"enable_task_events": value == "1"}


def inline_bytes() -> int:
    """The largest call argument or result sent inline (``INLINE_BYTES``, or the
    environment's ``DISTBELIEF_INLINE_BYTES``, which an embedded session's workers inherit)."""
    value = os.environ.get(INLINE_ENV, "").strip()
    if not value:
        return INLINE_BYTES
    if not value.isdigit():
        raise UserError(f"{INLINE_ENV}={value!r} is not a byte count: set it to a whole "
                        "number of bytes (Ray's own default is 102400) or unset it")
    return int(value)


@contextmanager
def session(address: str | None = None, num_cpus: int | None = None,
            object_store_memory: int | None = None) -> Iterator[bool]:
    """Connect for the duration of a ``with`` block; yields True if this call started Ray.

    An already-initialised Ray session (a notebook, a test module) is reused and left
    running. Otherwise Ray is started (embedded) or joined (``address``) and shut down at
    the end of the block.
    """
    if ray.is_initialized():
        yield False
        return
    connect(address, num_cpus=num_cpus, object_store_memory=object_store_memory)
    try:
        yield True
    finally:
        ray.shutdown()


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_memory: int | None = None) -> None:
    """Start an embedded loopback-only Ray instance, or join the cluster at ``address``.

    ``num_cpus`` (embedded only) is the number of logical CPUs Ray schedules actors on;
    ``object_store_memory`` is in bytes. Raises :class:`UserError` for an unreachable or
    unauthenticated cluster, or a bad ``DISTBELIEF_TASK_EVENTS`` (named before Ray starts).
    """
    actor_options()
    if address:
        _join(address)
        return
    saved = os.environ.get(_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                 configure_logging=True,
                 _system_config={"max_direct_call_object_size": inline_bytes()})
    finally:
        if saved[0] is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


def _join(address: str) -> None:
    if not address.startswith("ray://") and address != "auto":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise UserError(f"--address {address!r} is not HOST:PORT: pass the head node's "
                            "address as printed by `ray start --head`, e.g. 127.0.0.1:6379")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as err:
            raise UserError(f"cannot reach a Ray cluster at {address} ({err.strerror or err}): "
                            "start one with `ray start --head` or fix --address") from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ray.exceptions.AuthenticationError:
        raise UserError(f"the Ray cluster at {address} rejected our token: set RAY_AUTH_MODE="
                        "token and the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
                        ) from None
    except (ConnectionError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot join the Ray cluster at {address} ({first}): check that "
                        "`ray status` works there and that versions match") from None


def node_id() -> str:
    """The Ray node this process runs on (for placement records)."""
    return ray.get_runtime_context().get_node_id()
