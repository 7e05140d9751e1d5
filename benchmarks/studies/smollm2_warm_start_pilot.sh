#!/usr/bin/env bash
# The learning-rate pilot of the SmolLM2 warm-start study: own head and MoS-2, 50 steps of 512
# cached train tokens, at 1e-4, 3e-4 and 1e-3, judged on the valid slice only. Uses the
# study's caches (run python -m benchmarks.studies.smollm2_warm_start --only cache first). Two processes of
# one thread each; records in benchmarks/results/smollm2-warm-start/pilot/lr-*/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
cache=${CACHE_DIR:-$HOME/.cache/highrank/smollm2-warm-start}
pilot() {
    python -m benchmarks.studies.smollm2_warm_start --cache-dir "$cache" --work-dir "$cache/pilot-lr-$1" \
        --out "${OUT_ROOT:-benchmarks/results/smollm2-warm-start}/pilot/lr-$1" --lr "$1" --steps 50 \
        --warmup-steps 5 --heads own,mos2 --seeds 1 --no-rank --no-base --only train
}
(pilot 1e-4; pilot 1e-3) &
pilot 3e-4
wait
