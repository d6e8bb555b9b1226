#!/usr/bin/env bash
# bench-anchors.sh — kvshard bench next to llama.cpp's and ik_llama.cpp's llama-bench (and
# llama.cpp's llama-batched-bench) on the same TinyLlama-1.1B-shape files (or another
# kvshard mkmodel shape: SHAPE), in alternating
# rounds, printed as one table. The anchors are not part of this repository: build them
# yourself, outside it, and name their binaries in the environment:
#
#   LLAMA_BENCH=/path/llama.cpp/build/bin/llama-bench
#   IK_LLAMA_BENCH=/path/ik_llama.cpp/build/bin/llama-bench
#   LLAMA_BATCHED_BENCH=/path/llama.cpp/build/bin/llama-batched-bench
#
# An anchor left unset is skipped (its columns say "-"). Other settings (defaults):
#   KVSHARD=build/kvshard  SCRATCH=/tmp/kvshard-anchors (model files, logs; outside the repo)
#   SHAPE=tinyllama-1.1b (kvshard mkmodel --shape; files SCRATCH/tinyllama-TYPE.gguf, other shapes
#   SCRATCH/SHAPE-TYPE.gguf, e.g. SHAPE=smollm2-360m TYPES="q4_0 q8_0": rows of 960 take no k-quant)
#   ARCH=llama (kvshard mkmodel --arch: qwen3, gemma3 or phi3 give that family's file at SHAPE,
#   named SCRATCH/ARCH-SHAPE-TYPE.gguf; e.g. ARCH=gemma3 TYPES=q4_k_m SESSIONS= DEPTH=)
#   TYPES="q4_0 q8_0 q4_k q4_k_m"  ROUNDS=2  THREADS=2  PP=128  TG=32  SESSIONS="1 4 8" (empty: no batched part)
#   PAIRED=32 (empty: none): kvshard bench --paired PAIRED, the roofline per decode step against
#   a probe pass right after it (the "paired" column; "roofline" is the bench's decode_roofline)
#   IK_LLAMA_ARGS=""  (extra llama-bench arguments for ik_llama.cpp, e.g. "-rtr 1": its run-time repacking)
#   DEPTH=2016 (empty: no depth part): decode after DEPTH positions against after PP, per type —
#   kvshard bench --depth (both sessions in one process, alternating step by step) and, when
#   LLAMA_BATCHED_BENCH is set, llama.cpp's S_TG at -npp PP and -npp DEPTH (-npl 1)
#
# Usage: bash scripts/bench-anchors.sh        (run from the repository root)
set -euo pipefail

KVSHARD=${KVSHARD:-build/kvshard}
SCRATCH=${SCRATCH:-/tmp/kvshard-anchors}
TYPES=${TYPES:-q4_0 q8_0 q4_k q4_k_m}
SHAPE=${SHAPE:-tinyllama-1.1b}
prefix=$SHAPE
[ "$SHAPE" = tinyllama-1.1b ] && prefix=tinyllama
ARCH=${ARCH:-llama}
[ "$ARCH" = llama ] || prefix="$ARCH-$prefix"
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
PP=${PP:-128}
TG=${TG:-32}
SESSIONS=${SESSIONS-1 4 8}
DEPTH=${DEPTH-2016}
PAIRED=${PAIRED-32}
LLAMA_BENCH=${LLAMA_BENCH:-}
IK_LLAMA_BENCH=${IK_LLAMA_BENCH:-}
LLAMA_BATCHED_BENCH=${LLAMA_BATCHED_BENCH:-}
IK_LLAMA_ARGS=${IK_LLAMA_ARGS:-}

die() { echo "bench-anchors: $*" >&2; exit 1; }
[ -x "$KVSHARD" ] || die "no kvshard binary at '$KVSHARD' (build first or set KVSHARD)"
for v in LLAMA_BENCH IK_LLAMA_BENCH LLAMA_BATCHED_BENCH; do
    p=${!v}
    if [ -n "$p" ] && [ ! -x "$p" ]; then die "$v='$p' is not an executable"; fi
done
. "$(dirname "$0")/bench_common.sh"
bench_scratch "$SCRATCH" log

# A JSON number field of kvshard bench's one-line output.
jnum() { sed -n "s/.*\"$1\":\([-0-9.eE+]*\).*/\1/p" "$2"; }
# A JSON string field.
jstr() { sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p" "$2"; }
# The "kernels" object of kvshard bench, braces and quotes dropped.
jkern() { sed -n 's/.*"kernels":{\([^}]*\)}.*/\1/p' "$1" | tr -d '"'; }
# avg_ts of llama-bench's test with n_prompt == $2 (pp) or n_gen == $3 (tg), from its json or
# jsonl output (llama.cpp writes jsonl; ik_llama.cpp's llama-bench only json): the fields are
# split one per line and read in order, each test's avg_ts coming after its n_prompt / n_gen.
lb_ts() {
    tr ',{}' '\n\n\n' < "$1" | awk -v pp="$2" -v tg="$3" '
        /"n_prompt"/ { np = $0; sub(/.*"n_prompt": */, "", np); sub(/[^0-9].*/, "", np) }
        /"n_gen"/ { ng = $0; sub(/.*"n_gen": */, "", ng); sub(/[^0-9].*/, "", ng) }
        /"avg_ts"/ {
            ts = $0; sub(/.*"avg_ts": */, "", ts); sub(/[^0-9.].*/, "", ts)
            if ((pp > 0 && np == pp && ng == 0) || (tg > 0 && ng == tg && np == 0)) { print ts; exit }
        }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || a == "-" || b == "-" || b + 0 == 0) print "-"; else printf "%.2f", a / b }'; }
or_dash() { if [ -n "$1" ]; then echo "$1"; else echo "-"; fi; }

echo "bench-anchors: $(date -u +%FT%TZ) cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs;" \
     "load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for t in $TYPES; do
    f="$scratch/$prefix-$t.gguf"
    if [ ! -s "$f" ]; then
        echo "bench-anchors: making $f" >&2
        "$KVSHARD" mkmodel -o "$f" --shape "$SHAPE" --type "$t" --arch "$ARCH" --seed 1 -q
    fi
done

# Results: one file per (engine, type, round, metric) under $log/res.
res="$log/res"
rm -rf "$res"
mkdir -p "$res"
put() { echo "$4" > "$res/$1.$2.$3"; }                      # engine type round value-name
get() { cat "$res/$1.$2.$3" 2>/dev/null || true; }

run_kvshard() { # type round
    local f="$scratch/$prefix-$1.gguf" o="$log/kvshard-$1-r$2.json"
    "$KVSHARD" bench -m "$f" -t "$THREADS" -p "$PP" -n "$TG" ${PAIRED:+--paired "$PAIRED"} > "$o" 2> "$log/kvshard-$1-r$2.err"
    put kv "$1" "r$2.pp" "$(jnum prefill_tok_s "$o")"
    put kv "$1" "r$2.tg" "$(jnum decode_tok_s "$o")"
    put kv "$1" "r$2.bw" "$(jnum mem_bw_gbs "$o")"
    put kv "$1" "r$2.roof" "$(jnum decode_roofline "$o")"
    put kv "$1" "r$2.proof" "$(jnum decode_roofline_paired "$o")"
    put kv "$1" "r$2.load" "$(jnum load_s "$o")"
    put kv "$1" "kernels" "$(jkern "$o")"
    put kv "$1" "commit" "$(jstr commit "$o")"
}
run_llama_bench() { # tag binary type round output-format [extra args]
    local f="$scratch/$prefix-$3.gguf" o="$log/$1-$3-r$4.$5"
    "$2" -m "$f" -t "$THREADS" -p "$PP" -n "$TG" -r 1 -o "$5" ${6:-} > "$o" 2> "$log/$1-$3-r$4.err" || true
    put "$1" "$3" "r$4.pp" "$(lb_ts "$o" "$PP" 0)"
    put "$1" "$3" "r$4.tg" "$(lb_ts "$o" 0 "$TG")"
}

# Alternating rounds: each round runs every engine once per type, the engine order
# rotating from round to round so that none always runs first (or last) in a slow spell.
engines=(kv)
[ -n "$LLAMA_BENCH" ] && engines+=(lc)
[ -n "$IK_LLAMA_BENCH" ] && engines+=(ik)
for ((r = 1; r <= ROUNDS; r++)); do
    for t in $TYPES; do
        n=${#engines[@]}
        for ((i = 0; i < n; i++)); do
            e=${engines[$(((i + r - 1) % n))]}
            echo "bench-anchors: round $r $t $e" >&2
            case $e in
            kv) run_kvshard "$t" "$r" ;;
            lc) run_llama_bench lc "$LLAMA_BENCH" "$t" "$r" jsonl ;;
            ik) run_llama_bench ik "$IK_LLAMA_BENCH" "$t" "$r" json "$IK_LLAMA_ARGS" ;;
            esac
        done
    done
done

# Batched decode (q4_0 if listed, else the first type): aggregate decode tok/s at each
# session count, kvshard bench --sessions N vs llama-batched-bench -npl N (S_TG column).
btype=q4_0
case " $TYPES " in *" q4_0 "*) ;; *) btype=${TYPES%% *} ;; esac
bf="$scratch/$prefix-$btype.gguf"
for ((r = 1; r <= ROUNDS && ${#SESSIONS} > 0; r++)); do
    for s in $SESSIONS; do
        echo "bench-anchors: round $r batched $btype x$s" >&2
        o="$log/kvshard-batched-$s-r$r.json"
        "$KVSHARD" bench -m "$bf" -t "$THREADS" -p "$PP" -n "$TG" --sessions "$s" > "$o" 2> /dev/null || true
        put kv batched "r$r.s$s" "$(jnum decode_tok_s "$o")"
        if [ -n "$LLAMA_BATCHED_BENCH" ]; then
            o="$log/lc-batched-$s-r$r.md"
            "$LLAMA_BATCHED_BENCH" -m "$bf" -t "$THREADS" -c $(((PP + TG) * s + 256)) -b 2048 -ub 512 \
                -npp "$PP" -ntg "$TG" -npl "$s" > "$o" 2> /dev/null || true
            # table row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
            put lc batched "r$r.s$s" "$(awk -F'|' -v b="$s" 'NF > 9 && $4 + 0 == b && $2 ~ /[0-9]/ { gsub(/ /, "", $9); print $9; exit }' "$o")"
        fi
    done
done

# Decode at DEPTH positions against PP: kvshard bench --depth, and llama-batched-bench's S_TG.
for ((r = 1; r <= ROUNDS && ${#DEPTH} > 0; r++)); do
    for t in $TYPES; do
        f="$scratch/$prefix-$t.gguf"
        echo "bench-anchors: round $r depth $t" >&2
        o="$log/kvshard-depth-$t-r$r.json"
        "$KVSHARD" bench -m "$f" -t "$THREADS" -p "$PP" -n "$TG" --depth "$DEPTH" > "$o" 2> /dev/null || true
        put kv "$t" "r$r.dtg0" "$(jnum decode_tok_s "$o")"
        put kv "$t" "r$r.dtg" "$(jnum decode_depth_tok_s "$o")"
        put kv "$t" "r$r.dslow" "$(jnum depth_slowdown "$o")"
        if [ -n "$LLAMA_BATCHED_BENCH" ]; then
            for np in "$PP" "$DEPTH"; do
                o="$log/lc-depth-$t-$np-r$r.md"
                "$LLAMA_BATCHED_BENCH" -m "$f" -t "$THREADS" -c $((DEPTH + TG + 256)) -b 2048 -ub 512 \
                    -npp "$np" -ntg "$TG" -npl 1 > "$o" 2> /dev/null || true
                put lc "$t" "r$r.d$np" "$(awk -F'|' 'NF > 9 && $4 + 0 == 1 && $2 ~ /[0-9]/ { gsub(/ /, "", $9); print $9; exit }' "$o")"
            done
        fi
    done
done

# ---- the table ----
echo
echo "kvshard $(get kv "${TYPES%% *}" commit), shape $SHAPE, $THREADS threads, pp$PP / tg$TG, $ROUNDS alternating round(s);" \
     "cpu $(lscpu | sed -n 's/^Model name: *//p' | head -1); load average now $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| type | round | kvshard pp / tg (tok/s) | bw GB/s | roofline | paired | kvshard load s | llama.cpp pp / tg | ik_llama.cpp pp / tg | pp vs ik | tg vs best anchor | kvshard kernels |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for t in $TYPES; do
    for ((r = 1; r <= ROUNDS; r++)); do
        kp=$(or_dash "$(get kv "$t" "r$r.pp")"); kt=$(or_dash "$(get kv "$t" "r$r.tg")")
        lp=$(or_dash "$(get lc "$t" "r$r.pp")"); lt=$(or_dash "$(get lc "$t" "r$r.tg")")
        ip=$(or_dash "$(get ik "$t" "r$r.pp")"); it=$(or_dash "$(get ik "$t" "r$r.tg")")
        best=$(awk -v a="$lt" -v b="$it" 'BEGIN { a = (a == "-") ? -1 : a + 0; b = (b == "-") ? -1 : b + 0;
                                               m = a > b ? a : b; if (m < 0) print "-"; else print m }')
        echo "| $t | $r | $kp / $kt | $(or_dash "$(get kv "$t" "r$r.bw")") | $(or_dash "$(get kv "$t" "r$r.roof")") | $(or_dash "$(get kv "$t" "r$r.proof")") |" \
             "$(or_dash "$(get kv "$t" "r$r.load")") | $lp / $lt | $ip / $it | $(ratio "$kp" "$ip") | $(ratio "$kt" "$best") | $(get kv "$t" kernels) |"
    done
done
if [ ${#SESSIONS} -gt 0 ]; then
    echo
    echo "Batched decode, $btype, ${PP}-token prompts, aggregate tok/s (kvshard bench --sessions N vs llama-batched-bench -npl N):"
    echo
    echo "| round | sessions | kvshard | llama.cpp | ratio |"
    echo "|---|---|---|---|---|"
    for ((r = 1; r <= ROUNDS; r++)); do
        for s in $SESSIONS; do
            a=$(or_dash "$(get kv batched "r$r.s$s")"); b=$(or_dash "$(get lc batched "r$r.s$s")")
            echo "| $r | $s | $a | $b | $(ratio "$a" "$b") |"
        done
    done
fi
if [ ${#DEPTH} -gt 0 ]; then
    echo
    echo "Decode after $DEPTH positions against after $PP, tok/s (kvshard bench --depth $DEPTH: one process, step by step;" \
         "llama.cpp: llama-batched-bench -npl 1, S_TG):"
    echo
    echo "| type | round | kvshard at $PP / at $DEPTH | kvshard slowdown | llama.cpp at $PP / at $DEPTH | llama.cpp slowdown |"
    echo "|---|---|---|---|---|---|"
    for t in $TYPES; do
        for ((r = 1; r <= ROUNDS; r++)); do
            a=$(or_dash "$(get lc "$t" "r$r.d$PP")"); b=$(or_dash "$(get lc "$t" "r$r.d$DEPTH")")
            echo "| $t | $r | $(or_dash "$(get kv "$t" "r$r.dtg0")") / $(or_dash "$(get kv "$t" "r$r.dtg")") |" \
                 "$(or_dash "$(get kv "$t" "r$r.dslow")") | $a / $b | $(ratio "$a" "$b") |"
        done
    done
fi
echo
echo "logs: $log"
