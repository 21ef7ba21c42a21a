#!/usr/bin/env bash
# The GPU check as ONE short script, for a machine with an NVIDIA GPU; run from the repo root:
#     bash bench/gpu.sh      # log: ${OUT:-runs/gpu}/gpu.log; run folders under runs/gpu
# It runs tests/test_gpu.py (its CUDA tests run there, unlike on CPU-only CI), the CNN on real
# MNIST from the command line with 4 replicas sharing the GPU, and bench/workloads.py with
# replicas = the machine's cores (REPLICAS=... to change), its CPU methods and its GPU ones.
#
# torch: pyproject.toml pins torch==2.13.0, the CPU wheel CI installs. This script never lets
# pip replace a CUDA torch with it. Two ways to provide the rest:
#   - offline (the lent H200 image: its python3 already holds a CUDA torch, nothing can be
#     downloaded, Ray is missing): distbelief runs from src/ through PYTHONPATH, torch and the
#     other packages come from that python3, and wheels in .whl/ are installed with
#     --no-index --no-deps into /tmp/site: ray==2.60.0 for that Python (3.12 as last seen)
#     and those of its needs the image lacks (jsonschema, jsonschema-specifications,
#     referencing, rpds-py), fetched with `pip download --no-deps --only-binary=:all:
#     --python-version 3.12 --platform manylinux2014_x86_64 ...`. Check the ray wheel's size
#     against what a call may carry. PYTHON=... picks another python3.
#   - online (CUDA_INDEX set, e.g. CUDA_INDEX=https://download.pytorch.org/whl/cu128): a fresh
#     venv .venv-gpu gets torch==2.13.0 from that index first (its local version, 2.13.0+cu128,
#     satisfies the ==2.13.0 pin), then `pip install -e '.[test]'` keeps it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT" runs/gpu
exec > >(tee "$OUT/gpu.log") 2>&1

if [ -n "${CUDA_INDEX:-}" ]; then
    python3 -m venv .venv-gpu || exit 1
    .venv-gpu/bin/pip install -q torch==2.13.0 --index-url "$CUDA_INDEX" || exit 1
    .venv-gpu/bin/pip install -q -e '.[test]' || exit 1
    PY=.venv-gpu/bin/python
else
    PY=${PYTHON:-python3}
    if compgen -G ".whl/*.whl" > /dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
    fi
    export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

nvidia-smi -L || true
$PY -c "import torch, ray; assert torch.cuda.is_available(), 'this torch has no CUDA';
print('torch', torch.__version__, torch.cuda.get_device_name(0), '| ray', ray.__version__)" \
    || { echo "gpu.sh: no CUDA torch or no ray here (see the header)"; exit 1; }

R=${REPLICAS:-$(nproc)}
echo "== tests/test_gpu.py"
timeout 100 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py
tests=$?

echo "== the acceptance command on the GPU: --dataset mnist --model cnn, 4 replicas share it"
began=$(date +%s%N)
timeout 80 $PY -m distbelief.cli train --dataset mnist --model cnn --replicas 4 --shards 2 \
    --device cuda --gpus-per-replica 0.25 --no-progress --run-dir runs/gpu/mnist-cuda | tail -2
echo "wall_ms=$(( ($(date +%s%N) - began) / 1000000 ))"

# bench/workloads.py on this machine's cores (R replicas) and on its GPU; each workload's
# workloads.json under $OUT/<workload>/; the CNN also with R loops that never communicate
# (independent: what these cores give data parallelism at all) and in bfloat16 on the GPU
METHODS="single-1t single-all ddp downpour downpour-noeval single-gpu downpour-gpu"
echo "== bench/workloads.py cnn, replicas=$R"
timeout ${CNN_TIMEOUT:-200} $PY bench/workloads.py --workloads cnn --replicas "$R" \
    --cnn-batches $(( 40 * R )) --methods independent $METHODS single-gpu-bf16 \
    downpour-gpu-bf16 --out "$OUT/cnn"
echo "== bench/workloads.py mlp17m, replicas=$R"
timeout ${MLP_TIMEOUT:-160} $PY bench/workloads.py --workloads mlp17m --replicas "$R" \
    --mlp-batches $(( 16 * R )) --methods $METHODS --out "$OUT/mlp17m"
echo "gpu.sh: tests/test_gpu.py exit $tests"
exit $tests
