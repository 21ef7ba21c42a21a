"""A data folder several times larger than the memory a reader may use: written from an
iterator and read for a whole epoch in a fresh process, whose resident memory (peak RSS,
counting every mapped page) must stay far below the data's size and not grow with it."""

import json
import shutil
import subprocess
import sys

import pytest

FEATURES = 784  # an MNIST row: 3,136 bytes
ROWS_PER_FILE = 2048  # 6.4 MB files
CAP_MB = 32  # what reading may add to the process's resident memory

SCRIPT = """
import json, resource, sys
import numpy as np
import psutil
from distbelief.ondisk import DiskRows, write_chunks
from distbelief.sources import sampled_batches

path, files, features, rows_per_file = sys.argv[1], *map(int, sys.argv[2:])

def chunks(count, seed):
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        x = rng.random((rows_per_file, features), dtype=np.float32)
        yield x, rng.integers(0, 10, rows_per_file)

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

base = peak_mb()
write_chunks(path, chunks(files, 0), chunks(1, 1))
after_write = peak_mb()
rows = DiskRows(path)
batches = sampled_batches(rows, 0, 1, 256, seed=0)
total = 0.0
for _ in range(len(rows) // 256):  # one epoch: every row once, in a random order
    x, y = next(batches)
    total += float(x[:, 0].sum())
print(json.dumps({"base": base, "after_write": after_write, "after_read": peak_mb(),
                  "uss": psutil.Process().memory_full_info().uss / 2**20,
                  "data_mb": rows.nbytes / 2**20, "rows": len(rows)}))
"""


def measure(folder, files: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(files), str(FEATURES),
                          str(ROWS_PER_FILE)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(300)
def test_reading_a_folder_larger_than_memory_keeps_resident_memory_flat(tmp_path):
    try:
        small = measure(tmp_path / "small", 8)  # 49 MB
        large = measure(tmp_path / "large", 40)  # 245 MB: five times the small one
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    print(small, large)
    assert large["data_mb"] > 5 * CAP_MB
    for m in (small, large):
        assert m["after_write"] - m["base"] < CAP_MB  # the writer holds one chunk at a time
        assert m["after_read"] - m["base"] < CAP_MB  # the reader about one batch
        assert m["uss"] < m["base"] + CAP_MB
    # five times the data, about the same memory (malloc and page noise only)
    assert large["after_read"] - small["after_read"] < CAP_MB / 4
