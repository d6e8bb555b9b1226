#!/usr/bin/env bash
# Installs the Debian 12 packages kvshard needs, only when one is missing.
set -euo pipefail
pkgs=(build-essential cmake git libcjson-dev libsodium-dev libpcre2-dev libssl-dev libmicrohttpd-dev libcurl4-openssl-dev clang libclang-rt-14-dev)
# --test: what the test suite needs beyond the build: headless Chromium for the chat-page test,
# SIMDe (header-only) to run the AVX-512 kernels on CPUs without AVX-512 (the emu512_* tests),
# etcd-server (the cluster tests start real etcd processes), and Node.js/npm (for the openai client test) when no node is installed yet.
if [ "${1:-}" = "--test" ]; then
  pkgs+=(chromium libsimde-dev etcd-server)
  command -v npm >/dev/null 2>&1 || pkgs+=(nodejs npm)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
