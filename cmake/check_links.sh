#!/bin/sh
# sh cmake/check_links.sh "LAYER..." OBJECT...
# Fails when the object files of the named layers link in a cycle: it draws the graph "object A
# uses a symbol that object B defines" (nm) over those OBJECTs (CMake's, .../<target>.dir/src/
# <layer>/...) of a named layer, and names the first cycle it finds with one symbol per edge.
# A cycle means two files cannot be understood, tested or replaced one without the other; the
# include check (check_layers.cmake) cannot see it, since a cycle inside one layer breaks no
# include rule. CTest's `links` runs it over the build's own objects (CMakeLists.txt).
set -eu
[ $# -ge 2 ] || { echo "usage: $0 \"LAYER...\" OBJECT..." >&2; exit 2; }
layers=" $1 "
shift
list=$(mktemp)
trap 'rm -f "$list"' EXIT
# An argument may hold several objects separated by ";" (CMake's $<TARGET_OBJECTS>).
printf '%s\n' "$@" | tr ';' '\n' | while read -r obj; do
  [ -f "$obj" ] || { echo "links: $obj is missing (build first)" >&2; exit 1; }
  layer=${obj##*.dir/src/}
  layer=${layer%%/*}
  case $layers in *" $layer "*) echo "$obj" ;; esac
done >"$list"
[ -s "$list" ] || { echo "links: no object files of layers$layers given" >&2; exit 1; }
# nm -A -P: "FILE: SYMBOL TYPE ..."; type U is a use, any other (global) type a definition.
xargs nm -A -g -P <"$list" | awk '
  {
    obj = $1; sub(/:$/, "", obj); sub(/.*\.dir\/src\//, "", obj); sub(/\.o$/, "", obj)
    if ($3 == "U") { nuse++; use_obj[nuse] = obj; use_sym[nuse] = $2 }
    else if ($3 != "w" && $3 != "v") def[$2] = obj
    objs[obj] = 1
  }
  END {
    for (i = 1; i <= nuse; i++) {
      to = def[use_sym[i]]
      if (to == "" || to == use_obj[i]) continue
      e = use_obj[i] SUBSEP to
      if (!(e in via)) { via[e] = use_sym[i]; nout[use_obj[i]]++; out[use_obj[i], nout[use_obj[i]]] = to }
    }
    for (o in objs) if (!(o in state) && dfs(o, 0)) exit 1
    n = 0; for (o in objs) n++
    printf "links: %d objects of layers %s: no cycle\n", n, LAYERS
  }
  # Depth-first search; state 1 = on the path, 2 = done. Prints the cycle and returns 1 on a back edge.
  function dfs(v, depth,    i, w, k) {
    state[v] = 1; path[depth] = v
    for (i = 1; i <= nout[v]; i++) {
      w = out[v, i]
      if ((w in state) && state[w] == 1) {
        for (k = 0; path[k] != w; k++) ;
        printf "links: cycle:"
        for (; k < depth; k++) printf " %s -(%s)->", path[k], via[path[k], path[k + 1]]
        printf " %s -(%s)-> %s\n", v, via[v, w], w
        return 1
      }
      if (!(w in state) && dfs(w, depth + 1)) return 1
    }
    state[v] = 2
    return 0
  }
' LAYERS="$(echo $layers)"
