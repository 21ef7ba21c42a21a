"""keep_freed_memory: a worker's per-step buffers reuse the pages of the last step's.

Each case runs in a fresh interpreter, so glibc starts from its defaults and the setting does
not leak into the test process. Page faults are counted with getrusage (deterministic for a
given allocation pattern: no timing).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

# 40 MB: above glibc's largest dynamic mmap threshold (32 MB), so by default every such block
# is a fresh mapping whose pages fault in again on first touch.
LOOP = """
import json, resource, sys
import numpy as np
from distbelief.allocator import keep_freed_memory
took = keep_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(10 * 1024 * 1024, dtype=np.float32)  # 40 MB, every page written
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": faults}))
"""
# pages of a 40 MB block at the fewest: 2 MB each where transparent huge pages back it (NumPy
# asks for them on large arrays), else 4 KB each
HUGE_PAGES = 40 * 1024 * 1024 // (2 << 20)

glibc = pytest.mark.skipif(not sys.platform.startswith("linux")
                           or "libc.so" not in (ctypes.util.find_library("c") or ""),
                           reason="mallopt's thresholds are glibc's")


def run_loop(env: dict[str, str]) -> dict:
    """LOOP's result in a fresh interpreter with ``env``."""
    done = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    return json.loads(done.stdout)


@glibc
def test_a_block_freed_is_reused_without_faulting_its_pages_in_again(monkeypatch):
    monkeypatch.delenv("DISTBELIEF_KEEP_FREED_MEMORY", raising=False)
    out = run_loop(dict(os.environ))
    assert out["took"] is True
    assert out["faults"][0] >= HUGE_PAGES  # the first block's pages are new to the process
    assert max(out["faults"][1:]) < 10  # later blocks reuse them


@glibc
def test_the_switch_leaves_glibc_as_it_was():
    out = run_loop(dict(os.environ, DISTBELIEF_KEEP_FREED_MEMORY="0"))
    assert out["took"] is False
    # glibc's default maps a 40 MB block afresh each time, so every block faults
    assert min(out["faults"]) >= HUGE_PAGES
