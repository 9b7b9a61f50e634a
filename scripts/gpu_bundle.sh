#!/usr/bin/env bash
# Builds, on a machine with no GPU, everything scripts/gpu_check.sh runs on a GPU, into one folder that travels
# there (target/gpu-bundle by default, ignored by git; at most 60 MiB): then `scripts/gpu_check.sh --bundle DIR`
# runs on the GPU machine with no cargo, no nvcc and no build (a cold CUDA build takes over 6 minutes of a
# 15-minute loan). The folder holds autosp-gpu-bundle.tar.xz (gpu_check unpacks it under $TMPDIR; python3's
# lzma will do where xz is missing) and a copy of its MANIFEST; unpacked (also left in
# $CARGO_TARGET_DIR/gpu-bundle-files) it is:
#
#   bin/      the CUDA test binaries (autosp-kernels' cuda_attention and cuda_ops, the root's cuda_state: every
#             test built with `cfg(feature = "cuda")`) and the examples gpu_check runs (llama_longctx,
#             bench_attention, bench_memory, grad_compare), built with `--features cuda`, stripped; and the
#             root's nccl_overlap (two GPUs), built with `--features cuda,nccl`;
#   lib/      libcudart.so.13 of the toolkit the binaries were built with (candle-kernels links it; 1 MiB);
#   stubs/    stand-ins for the driver and toolkit libraries the binaries are linked against (libcuda.so.1,
#             libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13; libnccl.so.2 for nccl_overlap): every function returns an
#             error (libcuda's CUDA_ERROR_NO_DEVICE), so a binary started where a library is missing loads and
#             says "no CUDA device" instead of failing in the loader; `run` uses one only where the real library
#             is not found;
#   run       `run BIN ARGS...`: puts the real libraries (the driver's libcuda, the CUDA toolkit's or the
#             nvidia-* wheels' cuBLAS, cuRAND and NVRTC, where PyTorch's pip install puts them) before lib/ and
#             the stubs on LD_LIBRARY_PATH, and runs bin/BIN;
#   MANIFEST  what was built, from which commit, with which toolkit.
#
# Why the stubs are needed at all: candle-core turns on cudarc's `dynamic-linking` (the libraries are DT_NEEDED,
# not dlopened) and cargo features only add, so autosp cannot ask for cudarc's dlopen mode.
#
# The toolkit: nvcc and the CUDA headers from NVIDIA's PyPI wheels, pinned to 13.0 (installed once into
# $CUDA_PIP, default target/cuda-pip-13.0): the PTX candle-kernels embeds is JIT-compiled by the driver, which
# refuses PTX from a newer toolkit than its own, and the GPU machines' driver (580) is CUDA 13.0. The link needs
# the libraries only by name: the stubs above serve. CUDA_COMPUTE_CAP=90 (H100/H200) unless set. The build has its
# own target dir ($CARGO_TARGET_DIR, default target/cuda-build), so it leaves target/release alone. Needs network
# to PyPI the first time. A cold build took 49 minutes on a loaded 2-core machine (candle-kernels' build script
# twice: `-p autosp-kernels` resolves features apart from the root's); a rebuild after source changes about 10.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
BUNDLE="${1:-target/gpu-bundle}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda-build}"
CUDA_PIP="${CUDA_PIP:-target/cuda-pip-13.0}"
cuda_version=13.0  # the wheels' own patch levels differ: nvcc 13.0.88, runtime 13.0.96, cccl 13.0.85
max_mib=60

cuda_root="$CUDA_PIP/nvidia/cu13"
if [ ! -x "$cuda_root/bin/nvcc" ] || [ ! -f "$CUDA_PIP/.complete-$cuda_version" ]; then
  echo "gpu_bundle: installing nvcc and the CUDA $cuda_version headers from PyPI into $CUDA_PIP"
  rm -rf "$CUDA_PIP"
  python3 -m pip install --quiet --no-deps --disable-pip-version-check --target "$CUDA_PIP" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-cccl==13.0.85
  touch "$CUDA_PIP/.complete-$cuda_version"
fi
cuda_root="$(cd "$cuda_root" && pwd)"
export PATH="$cuda_root/bin:$PATH"
export CUDA_HOME="$cuda_root" CUDA_ROOT="$cuda_root" CUDA_PATH="$cuda_root"
export CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
nvcc_version="$(nvcc --version | grep -m1 release)"  # "Cuda compilation tools, release 13.0, V13.0.88"
echo "gpu_bundle: $nvcc_version, compute cap $CUDA_COMPUTE_CAP, target dir $CARGO_TARGET_DIR"

# --- the stubs: one C function per entry point cudarc declares for the library, each returning an error ---
cudarc_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10 | head -1)"
[ -d "$cudarc_src" ] || { echo "gpu_bundle: cudarc 0.19.10's source is not under \$CARGO_HOME/registry: run cargo fetch" >&2; exit 1; }
stubs="$CARGO_TARGET_DIR/cuda-stubs"
rm -rf "$stubs"
mkdir -p "$stubs"
# module soname link-name error-code (libcuda: CUDA_ERROR_NO_DEVICE = 100; cuBLAS: 1 = NOT_INITIALIZED; cuRAND:
# 201 = NOT_INITIALIZED; NVRTC: 11 = INTERNAL_ERROR; NCCL: 3 = ncclInternalError).
while read -r module soname name code; do
  names="$(grep -A1 'extern "C" {' "$cudarc_src/src/$module/sys/mod.rs" | sed -nE 's/^ +fn ([A-Za-z0-9_]+)\(.*/\1/p' | sort -u)"
  [ -n "$names" ] || { echo "gpu_bundle: no entry points found in cudarc's src/$module/sys/mod.rs" >&2; exit 1; }
  {
    echo "/* Stand-in for $soname (scripts/gpu_bundle.sh): every entry point returns $code. */"
    if [ "$name" = cuda ]; then
      # The driver's error strings still answer, so that errors read "no CUDA device", not "failure when
      # calling cuGetErrorString".
      names="$(grep -vx -e cuGetErrorString -e cuGetErrorName <<< "$names")"
      echo 'int cuGetErrorString(int e, const char **s) { *s = e == 100 ? "no CUDA-capable device is detected (autosp bundle stub libcuda: no NVIDIA driver on this machine)" : "unknown error (stub libcuda)"; return 0; }'
      echo 'int cuGetErrorName(int e, const char **s) { *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN"; return 0; }'
    fi
    for f in $names; do echo "int $f(void) { return $code; }"; done
  } > "$stubs/$name.c"
  cc -shared -fPIC -O1 -fno-builtin -Wl,-soname,"$soname" -o "$stubs/$soname" "$stubs/$name.c"
  ln -sf "$soname" "$stubs/lib$name.so"
done <<'EOF'
driver libcuda.so.1 cuda 100
cublas libcublas.so.13 cublas 1
cublaslt libcublasLt.so.13 cublasLt 1
curand libcurand.so.10 curand 201
nvrtc libnvrtc.so.13 nvrtc 11
nccl libnccl.so.2 nccl 3
EOF
# libcudart is the real one (candle-kernels' static MoE kernels call it); the linker wants the unversioned name.
ln -sf "$cuda_root/lib/libcudart.so.13" "$stubs/libcudart.so"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$(cd "$stubs" && pwd)"

# --- the build: examples and the CUDA tests, their executables' paths from cargo's JSON messages ---
t0=$SECONDS
examples=(llama_longctx bench_attention bench_memory grad_compare)
args=(--release --features cuda --message-format=json-render-diagnostics)
for e in "${examples[@]}"; do args+=(--example "$e"); done
cargo build "${args[@]}" > "$CARGO_TARGET_DIR/bundle-examples.json"
cargo test --no-run --release --features cuda --message-format=json-render-diagnostics \
  -p autosp-kernels --test cuda_attention --test cuda_ops > "$CARGO_TARGET_DIR/bundle-kernel-tests.json"
cargo test --no-run --release --features cuda --message-format=json-render-diagnostics \
  --test cuda_state > "$CARGO_TARGET_DIR/bundle-root-tests.json"
# The NCCL test: `nccl` adds cudarc's NCCL module, so its dependencies build apart from the others'.
cargo test --no-run --release --features cuda,nccl --message-format=json-render-diagnostics \
  --test nccl_overlap > "$CARGO_TARGET_DIR/bundle-nccl-tests.json"
echo "gpu_bundle: build $((SECONDS - t0)) s"

# The files go to a staging folder; the bundle is that folder as one .tar.xz (each binary carries the same 50 MB
# of CUDA kernels, PTX and the MoE fat binary, which xz's 256 MiB window stores once: ~10x smaller).
stage="$CARGO_TARGET_DIR/gpu-bundle-files"
rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/lib" "$stage/stubs"
cat "$CARGO_TARGET_DIR"/bundle-*.json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    kinds = m.get("target", {}).get("kind", [])
    if m.get("reason") == "compiler-artifact" and m.get("executable") and ("example" in kinds or "test" in kinds):
        print(m["executable"])' | sort -u | while read -r exe; do
  name="$(basename "$exe")"
  name="${name%-*[0-9a-f]}"   # cuda_ops-0123abcd -> cuda_ops (test executables carry a hash)
  strip -o "$stage/bin/$name" "$exe"
done
for b in "${examples[@]}" cuda_attention cuda_ops cuda_state nccl_overlap; do
  [ -x "$stage/bin/$b" ] || { echo "gpu_bundle: $b was not built" >&2; exit 1; }
done
cp -L "$cuda_root/lib/libcudart.so.13" "$stage/lib/"
for s in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnccl.so.2; do
  strip -o "$stage/stubs/$s" "$stubs/$s"
done
cp scripts/gpu_bundle_run.sh "$stage/run"
chmod +x "$stage/run"
{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $nvcc_version, CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
  echo "features cuda (nccl_overlap: cuda,nccl)"
  (cd "$stage" && find bin lib stubs -type f -printf '%s %p\n' | sort -k2)
} > "$stage/MANIFEST"

t0=$SECONDS
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
tar -C "$stage" -cf - MANIFEST run bin lib stubs | xz -6 --lzma2=preset=6,dict=256MiB -T1 > "$BUNDLE/autosp-gpu-bundle.tar.xz"
cp "$stage/MANIFEST" "$BUNDLE/MANIFEST"
echo "gpu_bundle: compressed in $((SECONDS - t0)) s ($(du -sh "$stage" | cut -f1) unpacked)"

size_kib=$(du -sk "$BUNDLE" | cut -f1)
echo "gpu_bundle: $BUNDLE: $((size_kib / 1024)) MiB ($size_kib KiB) in $((SECONDS - start)) s; unpacked: $stage"
if [ "$size_kib" -gt $((max_mib * 1024)) ]; then
  echo "gpu_bundle: the bundle is over $max_mib MiB" >&2
  exit 1
fi
