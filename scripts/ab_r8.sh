#!/usr/bin/env bash
# ab_r8.sh — build scripts/ab_r8.c against two versions of src/quant_r8_avx2.c (A and B) and run it,
# e.g. the committed kernels against the working copy:
#
#   git show HEAD:src/quant_r8_avx2.c > /tmp/r8_head.c
#   bash scripts/ab_r8.sh /tmp/r8_head.c src/quant_r8_avx2.c q8_0 4 128
#
# Arguments: A.c B.c [TYPE [T ...]] (TYPE q4_0|q8_0|q4_k|q6_k|q3_k|q2_k, with VNNI=1 also
# q4_0/pairs1, q8_0/pairs1, q4_0/quads1, q8_0/quads1, q4_k/quads1, q3_k/quads1, q2_k/quads1; default
# q8_0; token counts, default 8).
# Needs build/libkvshard_core.a (cmake --build build) for packing and quantizing. The binary goes to
# build/ab_r8; each count runs pinned to CPU 1 where taskset exists. VNNI=1 builds both as the AVX-512
# VNNI kernels (quant_r8_avx512.c's build: QUANT_R8_VNNI, 512-bit pair kernels) instead of AVX2.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash scripts/ab_r8.sh A.c B.c [TYPE [T ...]]" >&2; exit 2; }
a=$1 b=$2 type=${3:-q8_0}
shift 2; [ $# -gt 0 ] && shift
counts=("$@"); [ ${#counts[@]} -gt 0 ] || counts=(8)
[ -f build/libkvshard_core.a ] || { echo "ab_r8: build/libkvshard_core.a missing (cmake --build build)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
flags=(-O2 -mavx2 -mfma -mf16c -Isrc -Iinclude) isa=avx2
if [ "${VNNI:-0}" = 1 ]; then
    flags+=(-mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512dq -DQUANT_R8_VNNI=1) isa=avx512
fi
for v in a b; do # each version's exported kernels quant_ISA_r8_* renamed to vA_r8_* / vB_r8_*
    src=$a; [ $v = b ] && src=$b
    gcc "${flags[@]}" -c "$src" -o "$tmp/$v.raw.o"
    nm --defined-only -g "$tmp/$v.raw.o" | awk -v p="quant_${isa}_r8_" -v n="v${v}_r8_" \
        'index($3, p) == 1 { print $3, n substr($3, length(p) + 1) }' > "$tmp/$v.syms"
    objcopy --redefine-syms="$tmp/$v.syms" "$tmp/$v.raw.o" "$tmp/$v.o"
done
abflags=(); [ "${VNNI:-0}" = 1 ] && abflags=(-DAB_R8_VNNI=1)
gcc -O2 -Isrc -Iinclude "${abflags[@]}" scripts/ab_r8.c "$tmp/a.o" "$tmp/b.o" build/libkvshard_core.a -lm -lpthread -o build/ab_r8
pin=(); command -v taskset >/dev/null && pin=(taskset -c 1)
for t in "${counts[@]}"; do "${pin[@]}" build/ab_r8 "$type" "$t"; done
