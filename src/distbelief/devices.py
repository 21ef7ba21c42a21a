"""Where a replica computes (``--device``), and the host buffers between shards and device.

Shards always hold parameters on CPU as NumPy float32. A replica on a GPU keeps its model,
its batches, its loss and its gradients on the device; a :class:`DeviceBuffers` stages the
flat parameters (shards -> host -> device) and the flat gradient (device -> host -> shards)
through two host buffers allocated once (pinned when CUDA is available), so a step allocates
nothing. On CPU none of this is used: the flat model's own buffers are the NumPy arrays the
shard client reads and writes, as before.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from distbelief.errors import UserError, one_of

DEVICES = ("cpu", "cuda", "auto")
PRECISIONS = ("float32", "bfloat16")  # what a replica's forward computes in (--precision)
CPU = torch.device("cpu")


def cuda_available() -> bool:
    """Whether this process's torch has CUDA and sees at least one GPU."""
    return torch.cuda.is_available()


def replica_device(device: str) -> torch.device:
    """The torch device of ``--device`` in the calling (replica's) process: ``auto`` is
    ``cuda`` when this process sees a GPU (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor), else
    ``cpu``."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    return torch.device(device)


def autocast(device: torch.device, precision: str):
    """A context for a replica's forward and loss: none for ``float32``; for ``bfloat16``
    ``torch.autocast`` on ``device``'s type, so matrix products and convolutions run in
    bfloat16 while parameters, gradients and what the shards see stay float32 (losses and
    softmax autocast to float32). Backward runs outside it, as torch recommends."""
    one_of("--precision", precision, PRECISIONS)
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gpu_options(gpus_per_replica: float) -> dict:
    """Ray actor options for a replica's (or partition's) GPU share; none for 0, so a CPU
    run's actors are created exactly as without this option."""
    return {"num_gpus": gpus_per_replica} if gpus_per_replica else {}


def on_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` moved to ``device``; on CPU the same objects (no copy)."""
    if device.type == "cpu":
        return tensors
    return tuple(t.to(device, non_blocking=True) for t in tensors)


class DeviceBuffers:
    """Reusable host buffers for a flat parameter tensor ``flat`` (shape ``(numel,)``,
    float32) that lives on a device.

    ``params_np`` is the host buffer a fetch writes (NumPy view of a pinned tensor when
    ``pin``; default: pin when CUDA is available); :meth:`params_to_device` copies it into
    ``flat`` (non-blocking: later kernels on the same stream wait for it, and the step's
    ``float(loss)`` synchronises before the next fetch overwrites the buffer).
    :meth:`grad_to_host` copies a device gradient into the other host buffer and returns its
    NumPy view, ready to push. Both buffers are the same objects for the whole run.
    """

    def __init__(self, flat: torch.Tensor, pin: bool | None = None) -> None:
        pin = cuda_available() if pin is None else pin
        self.flat = flat
        self.host_params = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=pin)
        self.host_grad = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=pin)
        self.params_np: np.ndarray = self.host_params.numpy()
        self.grad_np: np.ndarray = self.host_grad.numpy()

    def params_to_device(self) -> None:
        """Copy the fetched host parameters into the device's flat parameters."""
        with torch.no_grad():
            self.flat.copy_(self.host_params, non_blocking=True)

    def grad_to_host(self, grad: torch.Tensor) -> np.ndarray:
        """Copy ``grad`` (device, ``(numel,)``) into the host gradient buffer (blocking, so
        it is complete on return); its NumPy view."""
        self.host_grad.copy_(grad)
        return self.grad_np


def check_gpus(device: str, gpus: float, partitions: int, click_data: bool) -> None:
    """``--device`` and ``--gpus-per-replica`` agree; GPU replicas only where they are built."""
    one_of("--device", device, DEVICES)
    if isinstance(gpus, bool) or not (isinstance(gpus, (int, float)) and math.isfinite(gpus)
                                      and gpus >= 0):
        raise UserError(f"--gpus-per-replica must be a number >= 0 (got {gpus!r})")
    if device == "cuda" and gpus == 0:
        raise UserError("--device cuda needs GPUs from Ray: pass --gpus-per-replica (e.g. 1, "
                        "or 0.5 for two replicas per GPU)")
    if device == "cpu" and gpus > 0:
        raise UserError(f"--gpus-per-replica {gpus} reserves GPUs that --device cpu does not "
                        "use: pass --device cuda (or auto), or drop --gpus-per-replica")
    if gpus > 0 and (partitions > 1 or click_data):
        raise UserError("GPU replicas train dense models without --partitions: model "
                        "partitions and click data (ctr) run on CPU, so drop --device and "
                        "--gpus-per-replica")


def check_cuda_here(device: str, gpus: float, address: str | None) -> None:
    """Refuse GPUs on a local run whose torch has no CUDA (Ray would wait for them forever)."""
    if gpus > 0 and address is None and not cuda_available():
        raise UserError(f"--device {device} --gpus-per-replica {gpus}: "
                        "this machine's torch has no CUDA (or no GPU) and no --address "
                        "cluster was given: install a CUDA build of torch (see bench/gpu.sh), "
                        "pass --address of a Ray cluster with GPUs, or use --device cpu")
