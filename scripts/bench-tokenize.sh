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
  code=$(find src tools -name '*.c' | sort)
  cat $code $code | head -c 524288
} > "$text"
set -o pipefail
echo "text: $(wc -c < "$text") bytes ($text)" >&2
for i in 1 2 3; do
  build/kvshard tokenize -m "$model" -f "$text" --stats > /dev/null
done
# Side by side with llama.cpp's tokenizer when its llama-tokenize is given (LLAMA_TOKENIZE=path):
# alternating rounds on the same text and file; wall time of the whole command (vocab load
# included) for both, and the token counts, which must agree.
if [ -n "${LLAMA_TOKENIZE:-}" ]; then
  now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
  for i in 1 2 3; do
    t0=$(now_ms)
    k=$(build/kvshard tokenize -m "$model" -f "$text" | tr -cd ',' | wc -c)
    t1=$(now_ms)
    l=$("$LLAMA_TOKENIZE" -m "$model" -f "$text" --ids --no-escape --log-disable 2>/dev/null | tr -cd ',' | wc -c)
    t2=$(now_ms)
    echo "round $i: kvshard ${k} ids+1 in $((t1 - t0)) ms, llama.cpp ${l} ids+1 in $((t2 - t1)) ms (whole command)"
  done
fi
