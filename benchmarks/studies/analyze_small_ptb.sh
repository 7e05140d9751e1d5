#!/usr/bin/env bash
# The bottleneck of the two small PTB recipes after one epoch: test perplexity, Press and
# epsilon-effective ranks of the PTB test log-probability matrix (82,429 x 10,000), the
# spectrum plot and the expected pairwise KL. Results go to
# benchmarks/results/analysis-small-ptb/ (README "The bottleneck in small PTB models").
# About 25 minutes on 2 CPU cores; run from the repository root, beside ../shared/data.
#
#   bash benchmarks/studies/analyze_small_ptb.sh [RUNS_DIR (default runs/analysis-small-ptb)]
set -euo pipefail
runs=${1:-runs/analysis-small-ptb}
out=benchmarks/results/analysis-small-ptb
mkdir -p "$out"
for head in softmax mos; do
  if [ ! -f "$runs/ptb-small-$head/checkpoints/best.pt" ]; then
    highrank train "configs/ptb/small-$head.toml" --train.epochs=1 \
      --run.out_dir="$runs/ptb-small-$head" --no-progress
  fi
  highrank eval "$runs/ptb-small-$head" --split test --no-progress
  cp "$runs/ptb-small-$head/eval-test-best.json" "$out/eval-test-small-$head.json"
done
highrank analyze rank "$runs/ptb-small-softmax" "$runs/ptb-small-mos" --keep-matrix --out "$out"
highrank analyze kl "$runs/ptb-small-softmax" "$runs/ptb-small-mos" --pairs 10000 \
  --matrix "$runs/ptb-small-softmax/analysis/logprob-test-best.npy" \
  --matrix "$runs/ptb-small-mos/analysis/logprob-test-best.npy" --out "$out" --no-progress
highrank analyze topk "$runs/ptb-small-mos" "$runs/ptb-small-softmax" --margin 2 --count 2 \
  --out "$out" --no-progress
highrank analyze similarity "$runs/ptb-small-softmax" "$runs/ptb-small-mos" \
  --data-dir ../shared/data/word-sim --out "$out"
highrank report "$runs/ptb-small-softmax" "$runs/ptb-small-mos" --out "$out/report"
# the side-by-side timing of the rank (numpy SVD in memory vs the streamed Gram matrix)
matrix="$runs/ptb-small-mos/analysis/logprob-test-best.npy"
python -m benchmarks.heads.rank_at_scale "$matrix" --methods numpy,gram-scipy \
  --out benchmarks/results/rank-at-scale/ptb-test-small-mos.json
python -m benchmarks.heads.rank_at_scale "$matrix" --methods gram-torch,gram-scipy --repeats 2 \
  --out benchmarks/results/rank-at-scale/ptb-test-small-mos-backends.json
