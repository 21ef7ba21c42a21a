"""Elastic replicas: asking a running Downpour job for another replica count.

A run with a folder marks itself running there (:data:`RUNNING`: the driver's process id and
host, and what the run may use); ``distbelief scale RUN_DIR --replicas N``
(:func:`request_scale`) checks the request against that and writes :data:`REQUEST`
atomically. :class:`ScaleRequests` is the driver's side: it takes requests from the Python
API (:meth:`~distbelief.downpour.DownpourSGD.scale`) or that file, and the driver applies the
newest at its probe cadence (see :class:`~distbelief.segments.WorkPool` for where the work
goes).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from distbelief.errors import UserError
from distbelief.limits import Resources, check_cpus

__all__ = ["REQUEST", "RUNNING", "ScaleRequests", "check_replicas", "request_scale",
           "running_run"]

RUNNING = "running.json"  # in a run folder while its driver runs
REQUEST = "scale.json"  # the newest scale request to a running run


def check_replicas(n: int, partitions: int, shard_actors: int, res: Resources) -> None:
    """Refuse a replica count below 1 or beyond what ``res`` can run (:func:`check_cpus`)."""
    if n < 1:
        raise UserError(f"--replicas {n}: a run needs at least one replica, pass 1 or more")
    check_cpus(n, partitions, shard_actors, res)


def _write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_run(run_dir: str | os.PathLike[str]) -> dict:
    """The :data:`RUNNING` record of the run in ``run_dir``; :class:`UserError` if there is
    none, or its driver (on this host) is gone."""
    path = Path(run_dir) / RUNNING
    hint = "give the --run-dir of a Downpour run in progress"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a running run (no {RUNNING}): {hint}")
    try:
        record = json.loads(path.read_text())
        pid, host = int(record["pid"]), str(record["host"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not a running run's record: {hint}") from None
    if host == socket.gethostname() and not _alive(pid):
        raise UserError(f"{run_dir}'s driver (process {pid}) is gone: {hint}")
    return record


def request_scale(run_dir: str | os.PathLike[str], replicas: int) -> dict:
    """Ask the run in ``run_dir`` for ``replicas`` replicas (checked against what it may
    use); the request written."""
    if replicas < 1:
        check_replicas(replicas, 1, 0, Resources(0, 1.0))  # before looking at the folder
    record = running_run(run_dir)
    res = Resources(int(record["memory"]), float(record["cpus"]), bool(record["cluster"]))
    check_replicas(replicas, int(record["partitions"]), int(record["shard_actors"]), res)
    request = {"replicas": replicas, "t": time.time()}
    _write_atomic(Path(run_dir) / REQUEST, request)
    return request


class ScaleRequests:
    """The driver's scale requests: from :meth:`ask` (the Python API, any thread) or from
    ``run_dir``'s :data:`REQUEST` file. While open, ``run_dir`` holds :data:`RUNNING`."""

    def __init__(self, run_dir: Path | None, partitions: int, shard_actors: int,
                 res: Resources) -> None:
        self.run_dir, self.partitions, self.shard_actors, self.res = (
            run_dir, partitions, shard_actors, res)
        self._asked: tuple[int, str] | None = None
        self._seen: int | None = None  # the request file's mtime already taken
        if run_dir is not None:
            _write_atomic(run_dir / RUNNING, {
                "pid": os.getpid(), "host": socket.gethostname(), "memory": res.memory,
                "cpus": res.cpus, "cluster": res.cluster, "partitions": partitions,
                "shard_actors": shard_actors})
            self._seen = self._mtime()

    def _mtime(self) -> int | None:
        try:
            return (self.run_dir / REQUEST).stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def ask(self, replicas: int, reason: str = "api") -> None:
        """Ask for ``replicas`` replicas (checked now; applied at the driver's next probe)."""
        check_replicas(replicas, self.partitions, self.shard_actors, self.res)
        self._asked = (replicas, reason)

    def take(self) -> tuple[int, str] | None:
        """The newest request not taken yet: ``(replicas, reason)``, or None."""
        asked, self._asked = self._asked, None
        if self.run_dir is not None and self._mtime() != self._seen:
            self._seen = self._mtime()
            try:
                replicas = int(json.loads((self.run_dir / REQUEST).read_text())["replicas"])
                check_replicas(replicas, self.partitions, self.shard_actors, self.res)
                asked = (replicas, f"{REQUEST}")
            except (OSError, ValueError, KeyError, TypeError, UserError):
                pass  # a bad file (written by hand): ignored, the CLI refuses such requests
        return asked

    def close(self) -> None:
        """The run ended: it no longer takes requests."""
        if self.run_dir is not None:
            for name in (RUNNING, REQUEST):
                (self.run_dir / name).unlink(missing_ok=True)
