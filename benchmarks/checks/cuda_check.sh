#!/usr/bin/env bash
# The GPU check of a lent CUDA machine, in one call (device time is scarce):
#   1. tests/test_cuda.py (every head, training + bit-identical resume, eval, rank, HF on CUDA)
#   2. highrank bench heads --device cuda (time and peak memory of every head)
#   3. the whole default suite with CUDA visible (run.device = auto picks the GPU), 16 workers
# Usage (repo root, on the GPU machine): OUT=folder bash benchmarks/checks/cuda_check.sh
# Results recorded in benchmarks/results/cuda-check/.
set -o pipefail
OUT=${OUT:-cuda-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried along (a newer transformers, say)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi -L
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0))"
  nproc
} 2>&1 | tee "$OUT/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 \
  | tee "$OUT/test_cuda.log" | tail -15
[ -n "$SKIP_BENCH" ] || timeout 120 python3 -m highrank bench heads --device cuda \
  --vocab 10000,33278,100000 --repeats 10 --warmup 3 --out "$OUT/bench-heads" 2>&1 \
  | tee "$OUT/bench-heads.log" | tail -20
timeout ${SUITE_SECONDS:-180} python3 -m pytest -q -p no:cacheprovider -n 16 tests \
  --maxfail=40 --deselect tests/test_cuda.py 2>&1 | tee "$OUT/suite.log" | tail -25
