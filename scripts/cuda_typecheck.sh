#!/usr/bin/env bash
# Type-checks the CUDA code on a machine with no GPU and no CUDA toolkit: `cargo clippy -D warnings` (which is
# `cargo check` plus lints) of the whole workspace, all targets, with `--features cuda,nccl` (and `mpi,cuda,nccl`
# when OpenMPI's headers are installed). It compiles the `cfg(feature = "cuda" / "nccl")` code (the NCCL back end,
# the CUDA tests, the device selection, llama_longctx's NCCL-over-MPI path) but never links nor runs it: no libcuda
# is needed, and passing says nothing of whether the code works on a GPU (scripts/gpu_check.sh checks that).
# `flash-attn` is not checked (its build clones CUTLASS and compiles for an hour).
#
# What the build scripts need: candle-kernels compiles its .cu files with nvcc (to PTX, and a static library for
# its MoE kernels), so nvcc and the CUDA headers come from NVIDIA's wheels on PyPI, pinned, installed once into
# $CUDA_PIP (default: cuda-pip under $CARGO_TARGET_DIR, else under target/; delete it to reinstall). cudarc's
# bindings are pre-generated: it only needs the CUDA version, given by CUDARC_CUDA_VERSION (the wheels' 13.2).
# CUDA_COMPUTE_CAP=90 (H100/H200) stands in for the GPU that nvidia-smi would report. Needs network to PyPI (the
# first time) and to crates.io (or the crates already fetched).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

cuda_version=13.2.86
CUDA_PIP="${CUDA_PIP:-${CARGO_TARGET_DIR:-target}/cuda-pip}"
cuda_root="$CUDA_PIP/nvidia/cu13"
if [ ! -x "$cuda_root/bin/nvcc" ] || [ ! -f "$CUDA_PIP/.complete-$cuda_version" ]; then
  echo "cuda_typecheck: installing nvcc and the CUDA $cuda_version headers from PyPI into $CUDA_PIP"
  rm -rf "$CUDA_PIP"
  # --no-deps: exactly these (nvcc's own requirements are runtime, crt and nvvm, listed here pinned).
  python3 -m pip install --quiet --no-deps --disable-pip-version-check --target "$CUDA_PIP" \
    "nvidia-cuda-nvcc==$cuda_version" "nvidia-cuda-runtime==$cuda_version" "nvidia-cuda-crt==$cuda_version" \
    "nvidia-nvvm==$cuda_version" "nvidia-cuda-cccl==$cuda_version"
  touch "$CUDA_PIP/.complete-$cuda_version"
fi
cuda_root="$(cd "$cuda_root" && pwd)"
export PATH="$cuda_root/bin:$PATH"
export CUDA_HOME="$cuda_root" CUDA_ROOT="$cuda_root" CUDA_PATH="$cuda_root"
export CUDARC_CUDA_VERSION=13020 CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# candle-kernels' build compiles its kernels on half the cores by default (cudaforge); the build script is most
# of a cold run's time, so use them all.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
echo "cuda_typecheck: $(nvcc --version | tail -1), compute cap $CUDA_COMPUTE_CAP"

feature_sets=(cuda,nccl)
if [ -n "$(mpicc --showme:compile 2>/dev/null)" ]; then
  feature_sets+=(mpi,cuda,nccl)
else
  echo "cuda_typecheck: no OpenMPI headers (mpicc): skipping --features mpi,cuda,nccl"
fi
for features in "${feature_sets[@]}"; do
  t0=$SECONDS
  # clippy type-checks everything `cargo check` does, and then lints it.
  cargo clippy --release --workspace --all-targets --features "$features" -- -D warnings
  echo "cuda_typecheck: --features $features: clippy (and so check) clean ($((SECONDS - t0)) s)"
done
echo "cuda_typecheck: done in $((SECONDS - start)) s"
