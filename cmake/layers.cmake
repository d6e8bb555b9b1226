# The layers of src/, lowest first, and the edges each may take (docs/design.md §1).
# One list for the build (each layer is an object library that sees only the headers of the
# layers it names) and for cmake/check_layers.cmake (which fails on an include outside these
# edges). A layer may name only layers before it, so the graph has no cycle.
set(KVS_LAYERS base quant compute gguf kv text gen engine net cluster shard route http)
set(KVS_LAYER_DEPS_base    "")
set(KVS_LAYER_DEPS_quant   base)
set(KVS_LAYER_DEPS_compute base quant)
set(KVS_LAYER_DEPS_gguf    base quant)
set(KVS_LAYER_DEPS_kv      base quant)
set(KVS_LAYER_DEPS_text    base gguf)
set(KVS_LAYER_DEPS_gen     base compute gguf text)
set(KVS_LAYER_DEPS_engine  base quant compute gguf kv text)
set(KVS_LAYER_DEPS_net     base)
set(KVS_LAYER_DEPS_cluster base)
set(KVS_LAYER_DEPS_shard   base quant compute gguf kv text engine net)
set(KVS_LAYER_DEPS_route   base compute gguf text net)
set(KVS_LAYER_DEPS_http    base compute gguf text gen net route)
# The layers whose object files link without a cycle (CTest `links`, cmake/check_links.sh);
# route and shard are left out: their files still call each other (route.c <-> route_spare.c,
# server_conn.c <-> server_sched.c); a follow-up of issue 37.
set(KVS_ACYCLIC_LAYERS base quant compute gguf kv text gen engine net http)
