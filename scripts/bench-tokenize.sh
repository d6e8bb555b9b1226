#!/usr/bin/env bash
# Tokenizer speed: MB/s of `kvshard tokenize` on 1 MiB of text, half English prose (the licence
# texts of /usr/share/common-licenses, twice) and half C code (this repository's src/ and tools/),
# with the Llama 3 download file. Prints the --stats line of each of 3 runs; the vocab load is
# timed apart (load_ms) and not counted in mb_s.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-../shared/downloads/models/llama3-synth-Q4_K_M.gguf}
text=build/bench-tokenize.txt
set +o pipefail # head closes the pipes early
{
  for i in 1 2; do cat /usr/share/common-licenses/*; done | head -c 524288
  cat src/*.c tools/*.c src/*.c tools/*.c | head -c 524288
} > "$text"
set -o pipefail
echo "text: $(wc -c < "$text") bytes ($text)" >&2
for i in 1 2 3; do
  build/kvshard tokenize -m "$model" -f "$text" --stats > /dev/null
done
