#!/usr/bin/env bash
# `run BIN ARGS...` in a GPU bundle (scripts/gpu_bundle.sh copies this file there as `run`): runs bin/BIN with
# the libraries it is linked against found on this machine. `run --libs` prints where each library comes from.
#
# The binaries need libcuda.so.1 (the driver's), libcublas.so.13, libcublasLt.so.13, libcurand.so.10 and
# libnvrtc.so.13 (the CUDA toolkit's, or the nvidia-* wheels' that PyTorch's pip install brings), nccl_overlap
# also libnccl.so.2 (NCCL's packages, or the nvidia-nccl wheel), and libcudart.so.13 (in the bundle's lib/). Each is looked for in the loader's cache (ldconfig -p), the CUDA
# toolkit's folders, the driver's /usr/local/nvidia, and the site-packages of python3; one not found is taken
# from the bundle's stubs/ (every function of a stub returns an error: libcuda's is CUDA_ERROR_NO_DEVICE), so
# that on a machine with no GPU a binary starts and says "no CUDA device" instead of failing in the loader.
# The links go in a folder under $TMPDIR (a fresh one per call).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# The folders searched after the loader's cache (the python3 site-packages' nvidia/*/lib and torch/lib included).
dirs=("${CUDA_HOME:-}/lib64" "${CUDA_PATH:-}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib
  /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64)
for py in python3 /opt/torch/.venv/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while read -r d; do dirs+=("$d"); done < <("$py" - 2>/dev/null <<'PY'
import glob, os, site, sys
roots = list(dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path]))
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))) + [os.path.join(r, "torch", "lib")]:
        if os.path.isdir(d):
            print(d)
PY
)
done
cache="$(ldconfig -p 2>/dev/null || true)"

find_lib() { # find_lib SONAME: the path of a real SONAME on this machine, or nothing
  local soname=$1 d found
  found="$(awk -v s="$soname" '$1 == s && /x86-64|x86_64/ { print $NF; exit }' <<< "$cache")"
  if [ -n "$found" ] && [ -e "$found" ]; then echo "$found"; return; fi
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -e "$d/$soname" ] && { echo "$d/$soname"; return; }
  done
  return 0
}

libs="$(mktemp -d "${TMPDIR:-/tmp}/autosp-gpu-libs.XXXXXX")"
trap 'rm -rf "$libs"' EXIT
report=""
for soname in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnccl.so.2; do
  real="$(find_lib "$soname")"
  if [ -n "$real" ]; then
    ln -s "$real" "$libs/$soname"
    report+="$soname $real"$'\n'
  else
    ln -s "$here/stubs/$soname" "$libs/$soname"
    report+="$soname STUB (not found on this machine: every call fails)"$'\n'
  fi
done
report+="libcudart.so.13 $here/lib/libcudart.so.13"$'\n'
export LD_LIBRARY_PATH="$here/lib:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ "${1:-}" = "--libs" ]; then
  printf '%s' "$report"
  exit 0
fi
[ $# -ge 1 ] || { echo "usage: $0 BIN [ARGS...] | --libs (binaries: $(ls "$here/bin" | tr '\n' ' '))" >&2; exit 2; }
bin="$here/bin/$1"
shift
[ -x "$bin" ] || { echo "run: no binary $bin in this bundle" >&2; exit 2; }
# Not exec: the trap removes the link folder when the binary ends.
"$bin" "$@"
