#!/usr/bin/env bash
# Builds kvshard and runs the main job: generate text from stories260K (or,
# when ../shared is absent, from a tiny model that kvshard mkmodel makes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
model="${KVS_SHARED_DIR:-../shared}/models/stories260K.gguf"
if [ ! -f "$model" ]; then
  echo "run: $model not found; generating a tiny synthetic model instead (random weights: its text is noise)" >&2
  model=build/tiny-q8_0.gguf
  ./build/kvshard mkmodel -o "$model" --shape tiny --type q8_0 --seed 1
fi
./build/kvshard run -m "$model" -p "${PROMPT:-Once upon a time}" -n "${N:-64}" --temp 0
