#!/bin/bash
# The GPU checks of the `cuda` and `nccl` features, as one script for a machine with a CUDA GPU (compute
# capability >= 8.0, CUDA >= 12, NCCL) and GitHub access (candle-flash-attn clones CUTLASS at build time).
# Builds both features, then runs the CUDA attention test (candle-flash-attn's output against the CPU
# kernel; LSE and gradients on CUDA are typed errors). The NCCL back end needs two GPUs for a real test;
# with one GPU it is only built here.
set -euo pipefail
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}"
cargo build --release --features cuda,nccl
cargo test --release --features cuda -p autosp-kernels --test cuda_attention -- --nocapture
