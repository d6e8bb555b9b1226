# bench_common.sh — sourced by the bench scripts (it defines, runs nothing).
# bench_scratch DIR LOGNAME: makes DIR, refuses one inside the repository (run from its root), and
# sets $scratch (DIR, resolved) and $log ($scratch/LOGNAME, made). The caller defines die().
bench_scratch() {
    local repo
    repo=$(pwd -P)
    mkdir -p "$1"
    scratch=$(cd "$1" && pwd -P)
    case "$scratch/" in "$repo"/*) die "SCRATCH ($scratch) must lie outside the repository" ;; esac
    log="$scratch/$2"
    mkdir -p "$log"
}
