#!/usr/bin/env bash
# Packs rig (and, when built, its GPU test binary) with the non-system shared libraries it links
# into one folder, so it runs on a GPU box that has the NVIDIA driver and CUDA libraries but none
# of the build's Debian packages. The binaries find the libraries through RPATH $ORIGIN/lib.
#   bash scripts/bundle.sh [BUILD_DIR] [OUT_DIR]      (defaults: build, dist/rig)
set -euo pipefail
build=${1:-build}
out=${2:-dist/rig}
mkdir -p "$out/lib"
bins=("$build/rig")
[ -x "$build/tests/rig_gpu_tests" ] && bins+=("$build/tests/rig_gpu_tests")
# Provided by the target: the C library, the driver, and the CUDA toolkit's own libraries.
skip='^(libc|libm|libdl|librt|libpthread|ld-linux.*|libcuda|libnvidia-.*|libcudart|libcublas.*|libnccl|libcudnn.*|libstdc\+\+|libgcc_s)\.so'
for b in "${bins[@]}"; do
  cp "$b" "$out/"
  ldd "$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -L "$path" "$out/lib/$name"
  done
done
if command -v patchelf >/dev/null; then
  # DT_RPATH (not RUNPATH) so that libraries' own dependencies are found there too.
  for b in "${bins[@]}"; do patchelf --force-rpath --set-rpath '$ORIGIN/lib' "$out/$(basename "$b")"; done
  for l in "$out"/lib/*; do patchelf --force-rpath --set-rpath '$ORIGIN' "$l"; done
fi
echo "bundled ${#bins[@]} binaries and $(ls "$out/lib" | wc -l) libraries into $out"
