#!/usr/bin/env bash
# The bottleneck map's cells of some output widths (benchmarks/studies/bottleneck_map.py) on one
# GPU machine: WORKERS study processes side by side (the stage locks share the cells out; one
# cell's LSTM leaves a GPU mostly idle), each cell trained there on the GPU and tested there
# (the analyses on the GPU, highrank eval on the CPU as it always scores),
# records into the repository's benchmarks/results/bottleneck-map/, and the files of those
# widths (records, pilots, the runs' and learning-rate checks' configs, curves and analyses, not
# their checkpoints, and the commands they ran) packed at the end into OUT_TGZ, to bring back
# and unpack over the folder:
#
#   [WORKERS=14] [DEVICE=cuda] bash benchmarks/studies/bottleneck_map_device.sh \
#       DATA_DIR WIDTHS OUT_TGZ [LIMIT_S]
#
# (DEVICE=cpu WORKERS=1 LIMIT_S=60 tries the script itself on a machine without a GPU.)
# DATA_DIR holds ptb/{train,valid,test}.txt (carry it: ../shared does not travel); WIDTHS is
# one or more of the map's widths (32, or 32,16): a width belongs to one kind of machine, so
# that its arms are compared on one device (a CPU process leaves to it the widths whose
# pilots ran on it: the pilots of 32 and 128 ran on an H100). The processes
# are interrupted after LIMIT_S seconds (default 480: a device call may run 600) and a rerun on the same machine continues from the records and
# checkpoints: a device call brings a fresh copy of the working tree, which drops the files the
# last call wrote into the map's folder (its records, the runs' configs) but keeps the ignored
# checkpoints, so each call leaves its files in /tmp/bottleneck-map-device/state-*.tgz (one
# archive per width, one for its command files) and the next one unpacks them first: they
# replace the tree's copies of the same files. Each call's commands are a file of their own,
# commands-gpu-d<W>-<UTC time>.txt. A run trained here but not tested before the machine goes back
# trains again on the next one (its checkpoint stays here): each cell's test follows its
# training at once.
# Measured on an H100 (2026-11-27, WORKERS=12, widths 32,128): the 12 learning-rate pilots
# took 100-190 s each side by side; then 12 cells trained side by side at 15-26 s an epoch each
# (36,000-63,000 tokens/s), so one width's 12 cells need about 7 minutes of training after their
# pilots: about 10 minutes of device time a width, two calls.
# WORKERS defaults to 14: d = 32 trains 12 cells and 2 learning-rate checks (LR_CHECKS), all
# side by side (with 12 processes two would wait a whole training); 14 is not yet measured.
set -uo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 DATA_DIR WIDTHS OUT_TGZ [LIMIT_S (480)]" >&2
    exit 2
fi
data=$(realpath "$1") widths=$2 archive=$(realpath -m "$3") limit=${4:-480}
workers=${WORKERS:-14} device=${DEVICE:-cuda}
source "$(dirname "$0")/../_workers.sh"
check_workers "$workers"
cd "$(dirname "$0")/../.." || exit 2  # the repository root
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
map=benchmarks/results/bottleneck-map
logs=/tmp/bottleneck-map-device
mkdir -p "$logs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$logs/gpu.txt" \
    || echo "no GPU: DEVICE=$device" > "$logs/gpu.txt"
# this machine's earlier calls' files, one archive per width (see above), restored first
for saved in "$logs"/state-*.tgz; do
    [ -f "$saved" ] || continue
    if ! tar xzf "$saved" -C "$map"; then
        echo "could not unpack $saved (an earlier call's records): stopping, nothing run" >&2
        exit 1
    fi
    echo "restored $saved (an earlier call on this machine)"
done
commands_before=$(wc -l < "$map/commands.txt" 2>/dev/null || echo 0)
pids=() worker_logs=()
for worker in $(seq 1 "$workers"); do
    worker_logs+=("$logs/worker-$worker.log")
    timeout --signal=INT --kill-after=30 "$limit" python3 -m benchmarks.studies.bottleneck_map \
        --device "$device" --widths "$widths" --no-long --data-dir "$data" \
        >> "${worker_logs[-1]}" 2>&1 &
    pids+=("$!")
done
wait_workers  # status: the worst worker's
grep -h -E "^(==|   .* done in|stopped)" "$logs"/worker-*.log | tail -n 40
kind=$([ "$device" = cpu ] && echo cpu || echo gpu)  # DEVICE=cpu trials are named so
tag=$kind-d${widths//,/-d}
cp "$logs/gpu.txt" "$map/$tag.txt"
# this call's commands alone, in a file of its own (earlier calls' files come back restored)
tail -n +"$((commands_before + 1))" "$map/commands.txt" \
    > "$map/commands-$tag-$(date -u +%Y%m%dT%H%M%SZ).txt"
save_state() {  # save_state ARCHIVE FILE...: atomically, so a killed call leaves the old one
    tar czf "$1.partial" --exclude=checkpoints --exclude='*.lock' -C "$map" "${@:2}" \
        && mv "$1.partial" "$1"
}
files=("$tag.txt" $(cd "$map" && ls commands-"$tag"-*.txt))
save_state "$logs/state-commands-$tag.tgz" "${files[@]}"
for width in ${widths//,/ }; do
    of_width=($(cd "$map" && ls -d records/*-d"$width"-* records/*-d"$width".json \
        pilots/*-d"$width"-* runs/*-d"$width"-seed* checks/*-d"$width"-lr* 2>/dev/null))
    files+=("${of_width[@]}")
    [ "${#of_width[@]}" -gt 0 ] && save_state "$logs/state-d$width.tgz" "${of_width[@]}"
done
tar czf "$archive" --exclude=checkpoints --exclude='*.lock' -C "$map" "${files[@]}"
echo "exit status $status (124: stopped at $limit s; rerun to continue);" \
    "$(tar tzf "$archive" | grep -c '^records/') records; $archive: $(du -h "$archive" | cut -f1)"
# here: tar xzf OUT_TGZ -C benchmarks/results/bottleneck-map, append each commands-gpu-*-STAMP.txt
# not appended before to .../commands.txt (the page's step), then --summarize
exit "$status"
