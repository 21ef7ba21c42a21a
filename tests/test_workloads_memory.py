"""Data larger than memory: a data folder trained on through the API, in a fresh driver
process, at two sizes (the larger ten times the smaller and several times the cap). Neither
the driver's nor a replica's peak resident memory may grow with the data set's size: the
driver ships the folder's path and scores the test split in batches; each replica reads its
own sampled rows from disk."""

import json
import shutil
import subprocess
import sys

import pytest

FEATURES = 784  # an MNIST row: 3,136 bytes
ROWS_PER_FILE = 2048  # 6.4 MB files
CAP_MB = 32  # what ten times the data may add to any process's peak resident memory

SCRIPT = """
import json, resource, sys
import numpy as np
from distbelief import DownpourSGD, models
from distbelief.ondisk import DiskRows, write_chunks

path, files = sys.argv[1], int(sys.argv[2])

def chunks(count, seed, rows=2048):
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        x = rng.random((rows, 784), dtype=np.float32)
        yield x, (x[:, 0] * 10).astype(np.int64)

write_chunks(path, chunks(files, 0), chunks(1, 1), classes=10)
train, test = DiskRows(path), DiskRows(path, "test")
trainer = DownpourSGD(models.mlp(784, 16, 10), replicas=2, shards=1, steps=40,
                      batch_size=64, num_cpus=3, eval_every_s=1.0)
result = trainer.fit(train, None, test)
data_events = [e for e in result.events if e["event"] == "replica_data"]
print(json.dumps({
    "driver_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "replica_mb": [e["rss_peak_bytes"] / 2**20 for e in data_events],
    "sources": [e["data_source"] for e in data_events],
    "data_mb": train.nbytes / 2**20, "updates": result.updates,
    "scored": result.test_accuracy is not None}))
"""


def measure(folder, files: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(files)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_training_on_a_folder_larger_than_memory_keeps_resident_memory_flat(tmp_path):
    try:
        small = measure(tmp_path / "small", 4)  # 25 MB
        large = measure(tmp_path / "large", 40)  # 245 MB: ten times the small one
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    print(small, large)
    assert large["data_mb"] > 5 * CAP_MB
    for m in (small, large):
        assert m["sources"] == ["DiskRows", "DiskRows"]
        assert m["updates"] == 2 * 40 and m["scored"]  # every step pushed; test split scored
    # ten times the data, about the same memory in the driver and in every replica
    assert large["driver_mb"] - small["driver_mb"] < CAP_MB
    assert max(large["replica_mb"]) - max(small["replica_mb"]) < CAP_MB
