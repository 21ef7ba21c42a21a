"""Downpour SGD against Ray's parameter-server example and PyTorch's RPC parameter-server tutorial.

Run: .venv/bin/python bench/peers.py [--workers 4] [--steps 250] [--lr 0.2] [--target 0.95]
     [--repeats 3] [--n-fetch 1] [--n-push 1] [--rpc-trainers 1] [--peers-dir /tmp/distbelief-peers]
     [--out runs/bench-peers]
The peers' own files are loaded at run time from --peers-dir (never copied into this project;
BENCHMARKS.md says how to get them with git):
  plot_parameter_server.ipynb (or .py)  ray-project/ray doc/source/ray-core/examples/
  rpc_parameter_server.py               pytorch/examples distributed/rpc/parameter_server/

Every system trains the CLI's 64-HIDDEN-10 MLP (same seed, so the same initial weights) on
scikit-learn's digits (the fixed 80/20 split of distbelief.data) with plain SGD at --lr on the
server, mini-batches of --batch-size, W = --workers workers and W x --steps mini-batches in all:
- downpour: DownpourSGD, W replicas, --shards shards, --n-fetch / --n-push (default 1).
- ray: the notebook's asynchronous variant as written: its ParameterServer and DataWorker
  actors and its driver loop (ray.wait on the first ready gradient, apply it, hand that
  worker the new weights), run from the notebook's own code. Substituted by name in its
  namespace: ConvNet -> the MLP (its get/set_weights and get/set_gradients methods kept,
  log_softmax output for its nll_loss), get_data_loader -> digits loaders (its shuffled
  DataLoader over the whole training set), evaluate -> full test-set accuracy with a
  timestamp, iterations = --steps, num_workers = W, ParameterServer(lr=--lr).
- rpc: the tutorial's processes as its launcher starts them (rank 0 parameter server, ranks
  1..W trainers, TensorPipe on 127.0.0.1), its TrainerNet / ParameterServer / dist_autograd /
  DistributedOptimizer(SGD) code unchanged. Substituted in its module: Net -> the MLP;
  the trainers get digits DataLoaders (shuffled whole training set, --steps batches each).
  Its learning rate is hard-coded (0.03), so its F.nll_loss is scaled by lr / 0.03: for
  plain SGD that is the same update as SGD at --lr. Its parameter server runs an evaluation
  thread on the server's own model every --eval-every s (Downpour's driver does the same
  from the shards).
Clocks exclude start-up for each: Downpour's starts at its "placement" event (every actor
up), Ray's once its actors answered __ray_ready__, RPC's when every trainer has built its
DistributedOptimizer (a barrier). Samples/s = samples trained / (last step - clock start).
Prints per repeat and the medians: samples/s, time to --target, final test accuracy, and
Downpour's ratios to each peer, taken within each repeat. Writes OUT/peers.json, OUT/peers.png.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (
    accuracy,
    add_comparison_args,
    downpour_curve,
    fmt,
    free_port,
    ray_session,
    time_to,
    write_results,
)
from _common import parser as make_parser
from figure4 import plot
from torch import nn

from distbelief import data, models

RAY_FILES = ("plot_parameter_server.ipynb", "plot_parameter_server.py")
RPC_FILE = "rpc_parameter_server.py"
RPC_LR = 0.03  # hard-coded in the tutorial's run_training_loop
HOW_TO_GET = "see BENCHMARKS.md, 'Downpour vs peers', for the git commands that fetch it"


# ---------------------------------------------------------------- the same model and data

class DigitsNet(nn.Module):
    """The CLI's MLP with a log-softmax output, which both peers' nll_loss expects."""

    hidden, seed = 64, 0

    def __init__(self, *_, **__) -> None:  # the peers call ConvNet() and Net(num_gpus=...)
        super().__init__()
        self.net = models.mlp(64, self.hidden, 10, self.seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net(x), dim=1)


def net_class(hidden: int, seed: int, methods: type | None = None) -> type:
    """DigitsNet of this size and seed, with the peer model's helper methods if given."""
    extra = {k: v for k, v in vars(methods).items()
             if callable(v) and k in ("get_weights", "set_weights", "get_gradients",
                                      "set_gradients")} if methods else {}
    return type("DigitsNet", (DigitsNet,), {"hidden": hidden, "seed": seed, **extra})


def digits_loaders(batch_size: int, batches: int | None = None):
    """(train, test) DataLoaders over digits, shuffled, as the peers build theirs for MNIST;
    ``batches`` fixes how many training batches one pass gives (reshuffling each epoch)."""
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    ds = data.digits()
    train = TensorDataset(torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train))
    test = TensorDataset(torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test))
    if batches is None:
        train_loader = DataLoader(train, batch_size=batch_size, shuffle=True)
    else:
        train_loader = DataLoader(train, batch_size=batch_size, drop_last=True,
                                  sampler=RandomSampler(train, num_samples=batches * batch_size))
    return train_loader, DataLoader(test, batch_size=batch_size, shuffle=True)


def test_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    ds = data.digits()
    return torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)


# ---------------------------------------------------------------- loading the peers' files

def peer_file(peers_dir: Path, names: tuple[str, ...], repo: str) -> Path:
    for name in names:
        if (peers_dir / name).is_file():
            return peers_dir / name
    sys.exit(f"bench peers: {peers_dir / names[0]} is missing: it is {repo}'s file; {HOW_TO_GET}"
             f" (or pass --peers-dir)")


@contextlib.contextmanager
def torchvision_stub():
    """Both peers import torchvision for MNIST, which we replace; a stand-in if it is absent."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    stub = types.ModuleType("torchvision")
    stub.datasets, stub.transforms = (types.ModuleType(f"torchvision.{m}")
                                      for m in ("datasets", "transforms"))
    sys.modules["torchvision"] = stub
    try:
        yield
    finally:
        sys.modules.pop("torchvision", None)


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def load_ray_peer(path: Path) -> tuple[types.ModuleType, types.CodeType]:
    """The Ray example's definitions (imports, functions, classes) as a module, and its
    asynchronous driver (``current_weights = ps.get_weights.remote()`` through the loop on
    ``ray.wait``) compiled to run in that module's namespace. Its other top-level code
    (``ray.init``, the synchronous run, MNIST set-up) is not run.

    The module stays out of ``sys.modules`` so that Ray ships its actors by value."""
    source = notebook_code(path) if path.suffix == ".ipynb" else path.read_text()
    body = ast.parse(source, str(path)).body
    defs = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                              ast.ClassDef))]
    loops = [i for i, n in enumerate(body) if isinstance(n, ast.For) and "ray.wait" in
             ast.unparse(n)]
    before = body[:loops[-1]] if loops else []
    starts = [i for i, n in enumerate(before) if isinstance(n, ast.Assign)
              and ast.unparse(n.targets[0]) == "current_weights"]
    if not loops or not starts:
        sys.exit(f"bench peers: {path} has no asynchronous driver loop (a top-level for loop on "
                 f"ray.wait after `current_weights = ...`): the example changed; {HOW_TO_GET}")
    module = types.ModuleType("ray_parameter_server_example")
    module.__file__ = str(path)
    with torchvision_stub():
        exec(compile(ast.Module(defs, []), str(path), "exec"), module.__dict__)
    driver = compile(ast.Module(body[starts[-1]:loops[-1] + 1], []), str(path), "exec")
    return module, driver


def load_rpc_peer(path: Path) -> types.ModuleType:
    """The PyTorch tutorial as the module ``rpc_parameter_server`` (its ``__main__`` launcher
    does not run). Registered in ``sys.modules``: RPC sends its functions by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rpc_parameter_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    with torchvision_stub():
        spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the three systems

def run_downpour(args) -> dict:
    from distbelief import DownpourSGD

    ds = data.digits()
    trainer = DownpourSGD(models.mlp(ds.features, args.hidden, ds.classes, args.seed),
                          replicas=args.workers, shards=args.shards, optimizer="sgd",
                          lr=args.lr, batch_size=args.batch_size, steps=args.steps,
                          n_fetch=args.n_fetch, n_push=args.n_push, seed=args.seed,
                          eval_every_s=args.eval_every)
    result = trainer.fit(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    start = next(e["t"] for e in result.events if e["event"] == "placement")
    steps = [e for e in result.events if e["event"] == "step"]
    return {"curve": downpour_curve(result.events), "samples": len(steps) * args.batch_size,
            "train_s": max(e["t"] for e in steps) - start, "final": result.test_accuracy}


def run_ray_example(args, path: Path) -> dict:
    import ray

    peer, driver = load_ray_peer(path)
    peer.ConvNet = net_class(args.hidden, args.seed, peer.ConvNet)
    peer.get_data_loader = _RayLoaders(args.batch_size)
    x_test, y_test = test_tensors()
    curve, began = [], [0.0]

    def evaluate(model, _test_loader):  # the example's call, on our whole test set
        acc = accuracy(model, x_test, y_test)
        curve.append((time.perf_counter() - began[0], acc))
        return 100.0 * acc

    with ray_session(args.workers + 1):
        ps = peer.ParameterServer.remote(args.lr)
        workers = [peer.DataWorker.remote() for _ in range(args.workers)]
        ray.get([a.__ray_ready__.remote() for a in [ps, *workers]])
        scope = dict(vars(peer), ps=ps, workers=workers, model=peer.ConvNet(),
                     test_loader=None, iterations=args.steps, num_workers=args.workers,
                     evaluate=evaluate, print=lambda *a, **k: None)
        began[0] = time.perf_counter()
        exec(driver, scope)
        train_s = time.perf_counter() - began[0]
        scope["model"].set_weights(ray.get(scope["current_weights"]))
        final = accuracy(scope["model"], x_test, y_test)
    curve.append((train_s, final))
    return {"curve": curve, "samples": args.steps * args.workers * args.batch_size,
            "train_s": train_s, "final": final}


class _RayLoaders:
    """The example's get_data_loader(), on digits (picklable: Ray ships it to its workers)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def __call__(self):
        return digits_loaders(self.batch_size)


class _ScaledF(types.ModuleType):
    """torch.nn.functional with nll_loss scaled: SGD at a hard-coded lr then steps at lr x scale."""

    def __init__(self, scale: float) -> None:
        super().__init__("torch.nn.functional")
        self.scale = scale

    def __getattr__(self, name: str):
        return getattr(F, name)

    def nll_loss(self, *a, **k):
        return F.nll_loss(*a, **k) * self.scale


def rpc_process(rank: int, args, path: str, port: int, barrier, out: str) -> None:
    """One process of the tutorial: rank 0 its parameter server, others its trainers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo",
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    log = os.open(Path(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 1)  # its progress prints, and any error, go to a log
    os.dup2(log, 2)
    peer = load_rpc_peer(Path(path))
    peer.Net = net_class(args.hidden, args.seed)
    if args.lr != RPC_LR:
        peer.F = _ScaledF(args.lr / RPC_LR)
    world = args.rpc_trainers + 1
    if rank == 0:
        x_test, y_test = test_tensors()
        curve, stop = [], threading.Event()

        def watch() -> None:  # the server's model, read while the trainers update it
            while not stop.is_set():
                if peer.param_server is not None:
                    curve.append((time.time(), accuracy(peer.param_server.model, x_test, y_test)))
                stop.wait(args.eval_every)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        peer.run_parameter_server(0, world)
        stop.set()
        thread.join()
        final = accuracy(peer.param_server.model, x_test, y_test)
        Path(out, "server.json").write_text(json.dumps({"curve": curve, "final": final}))
        return
    clock: dict[str, float] = {}
    make_optimizer, get_accuracy = peer.DistributedOptimizer, peer.get_accuracy

    def ready_optimizer(*a, **k):  # the last set-up step before its training loop
        opt = make_optimizer(*a, **k)
        barrier.wait()
        clock["t0"] = time.time()
        return opt

    def timed_accuracy(*a, **k):  # called right after its last training step
        clock["t1"] = time.time()
        return get_accuracy(*a, **k)

    peer.DistributedOptimizer, peer.get_accuracy = ready_optimizer, timed_accuracy
    train_loader, test_loader = digits_loaders(args.batch_size, rpc_steps(args))
    peer.run_worker(rank, world, 0, train_loader, test_loader)
    Path(out, f"trainer{rank}.json").write_text(json.dumps(clock))


def run_rpc_tutorial(args, path: Path) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # as the tutorial's launcher does
    port = free_port()
    barrier = ctx.Barrier(args.rpc_trainers)
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=rpc_process, args=(r, args, str(path), port, barrier, out))
                 for r in range(args.rpc_trainers + 1)]
        for p in procs:
            p.start()
        deadline = time.time() + 240
        while any(p.is_alive() for p in procs) and time.time() < deadline:
            if any(p.exitcode for p in procs):  # one died: the others would wait forever
                break
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        if any(p.exitcode != 0 for p in procs):
            errors = [line for r in range(len(procs))
                      for line in Path(out, f"rank{r}.log").read_text().splitlines()
                      if re.match(r"\w+(Error|Exception): ", line)]
            return {"failed": f"exit codes {[p.exitcode for p in procs]}, "
                              f"{errors[0][:300] if errors else 'no error line in its logs'}"}
        server = json.loads(Path(out, "server.json").read_text())
        clocks = [json.loads(Path(out, f"trainer{r}.json").read_text())
                  for r in range(1, args.rpc_trainers + 1)]
    start = min(c["t0"] for c in clocks)
    train_s = max(c["t1"] for c in clocks) - start
    curve = [(t - start, acc) for t, acc in server["curve"] if t >= start]
    curve.append((train_s, server["final"]))
    return {"curve": curve, "samples": rpc_steps(args) * args.rpc_trainers * args.batch_size,
            "train_s": train_s, "final": server["final"]}


def rpc_steps(args) -> int:
    """Mini-batches per RPC trainer: the same W x --steps in all as the other systems."""
    return args.steps * args.workers // args.rpc_trainers


# ---------------------------------------------------------------- main

def main() -> None:
    parser = make_parser(__doc__)
    add_comparison_args(parser, lr=0.2, lr_help="plain SGD, all three systems",
                        shards_help="Downpour's (the peers have one)")
    parser.add_argument("--rpc-trainers", type=int, default=1,
                        help="the RPC tutorial's trainers (it fails with more than one: "
                             "pytorch/examples#780); they share its W x --steps batches")
    parser.add_argument("--systems", nargs="+", default=["downpour", "ray", "rpc"],
                        choices=["downpour", "ray", "rpc"])
    parser.add_argument("--peers-dir", type=Path, default=Path("/tmp/distbelief-peers"))
    parser.add_argument("--out", default="runs/bench-peers")
    args = parser.parse_args()
    paths = {"ray": peer_file(args.peers_dir, RAY_FILES, "ray-project/ray")
             if "ray" in args.systems else None,
             "rpc": peer_file(args.peers_dir, (RPC_FILE,), "pytorch/examples")
             if "rpc" in args.systems else None}
    runners = {"downpour": lambda: run_downpour(args),
               "ray": lambda: run_ray_example(args, paths["ray"]),
               "rpc": lambda: run_rpc_tutorial(args, paths["rpc"])}
    results: dict[str, list[dict]] = {k: [] for k in args.systems}
    for r in range(args.repeats):
        for name in args.systems:
            res = runners[name]()
            if "failed" in res:
                print(f"repeat {r} {name:<8} FAILED: {res['failed']}", flush=True)
                continue
            res["sps"] = res["samples"] / res["train_s"]
            res["to_target"] = time_to(res["curve"], args.target)
            results[name].append(res)
            print(f"repeat {r} {name:<8} {res['sps']:8.0f} samples/s ({res['samples']} in "
                  f"{res['train_s']:.2f}s)  time to {args.target:.0%}: {fmt(res['to_target'])}  "
                  f"final acc {res['final']:.4f}", flush=True)
    print(f"\nworkers={args.workers} downpour shards={args.shards} n_fetch={args.n_fetch} "
          f"n_push={args.n_push} rpc trainers={args.rpc_trainers} steps/worker={args.steps} "
          f"batch={args.batch_size} sgd lr={args.lr} hidden={args.hidden} target={args.target}")
    print(f"{'system':<9}{'samples/s':>10}  {'range':<13}{'to target':>10}{'final acc':>11}")
    for name, runs in results.items():
        if not runs:
            print(f"{name:<9}failed in every repeat")
            continue
        sps = [x["sps"] for x in runs]
        hit = [x["to_target"] for x in runs if x["to_target"] is not None]
        med_t = statistics.median(hit) if len(hit) == len(runs) else None
        print(f"{name:<9}{statistics.median(sps):10.0f}  [{min(sps):.0f}-{max(sps):.0f}]"
              f"{'':<2}{fmt(med_t):>10}{statistics.median(x['final'] for x in runs):11.4f}"
              f"  ({len(hit)}/{len(runs)} reached)")
    verdict = None
    for peer in (p for p in ("ray", "rpc") if results.get(p) and results.get("downpour")):
        pairs = list(zip(results["downpour"], results[peer]))  # runs of the same repeat
        if len(results[peer]) != len(results["downpour"]):
            print(f"(some {peer} or downpour repeats failed: ratios pair runs in order)")
        sps = statistics.median(d["sps"] / p["sps"] for d, p in pairs)
        times = [p["to_target"] / d["to_target"] for d, p in pairs
                 if d["to_target"] and p["to_target"]]
        acc = statistics.median(d["final"] - p["final"] for d, p in pairs)
        print(f"downpour vs {peer:<4}: samples/s x{sps:.2f} (median of per-repeat ratios), "
              f"time to {args.target:.0%} {peer}/downpour = "
              f"{statistics.median(times) if times else float('nan'):.2f} "
              f"({len(times)}/{len(pairs)} repeats both reached), final acc difference "
              f"{acc:+.4f}")
        if peer == "ray":
            verdict = sps >= 2.0 and acc >= 0.0
    if verdict is not None:
        print(f"acceptance (downpour >= 2x ray's samples/s at equal or better final accuracy): "
              f"{'met' if verdict else 'NOT met'}")
    written = write_results(args.out, "peers.json",
                            {"args": {k: str(v) for k, v in vars(args).items()},
                             "results": results})
    curves = {name: runs[0]["curve"] for name, runs in results.items() if runs}
    print(f"wrote {written} and {plot(curves, Path(args.out) / 'peers.png', args.target)}")


if __name__ == "__main__":
    main()
