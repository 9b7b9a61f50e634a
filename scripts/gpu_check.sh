#!/usr/bin/env bash
# The one prepared device script: everything autosp checks on a CUDA GPU, in one run that fits in 8 minutes
# on a 16-core, 1-GPU machine with no network (README "Building with CUDA" says what it needs installed).
#
#   1. builds with `--features cuda` (candle's CUDA backend + the device-generic kernels), and with
#      `flash-attn` on top when CUTLASS is already on disk (candle-flash-attn's build clones it otherwise);
#   2. runs the CUDA tests (`autosp-kernels/tests/cuda_attention.rs`, `cuda_ops.rs`: the generic attention
#      and ops on CUDA against the CPU kernels, forward and backward, f32 and bf16; candle-flash-attn's
#      forward when built);
#   3. runs `llama_longctx --quick` on CUDA at P = 1 and 2 (thread ranks sharing the GPU) in f32 and bf16 and
#      compares every step's loss with the CPU run (f32: 1e-4 relative; bf16: 2e-2);
#   4. on CUDA: saves and resumes a run (the resumed losses must equal the uninterrupted run's bit for bit);
#      bf16 and f16 (dynamic loss scaling) against f32 over 20 steps (2e-2 relative); the host reads per step
#      (`host_reads` in the metrics: the same on every step, at most 3);
#   5. prints `bench_attention` on CUDA (generic attention vs candle-flash-attn forward, bf16, N = 16384,
#      head_dim 64 and 128), llama_longctx tokens/s at 8K and 32K tokens, and bench_memory's device-memory
#      peak at 8K against the plan's prediction (tape peak + model states).
#
# Results go to $OUT (default target/gpu_check): the logs, metrics and JSON lines.
# Crates: with no network, run `cargo vendor vendor/` on a machine with one first and bring `vendor/` along;
# the script then builds offline from it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-target/gpu_check}"
mkdir -p "$OUT"
log() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; }

command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: this needs an NVIDIA GPU and its driver" >&2; exit 2; }
command -v nvcc >/dev/null || export PATH="${CUDA_ROOT:-${CUDA_PATH:-/usr/local/cuda}}/bin:$PATH"
command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found: install the CUDA toolkit (>= 12) or set CUDA_ROOT" >&2; exit 2; }
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}"
log "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), compute cap $CUDA_COMPUTE_CAP, nvcc $(nvcc --version | tail -1)"

cargo_flags=(--release)
if [ -d vendor ]; then
  cargo_flags+=(--offline --config "source.crates-io.replace-with='vendored'" --config "source.vendored.directory='vendor'")
fi
features=cuda
if [ -d "${CUDAFORGE_HOME:-$HOME/.cudaforge}" ]; then
  features=cuda,flash-attn
else
  log "no CUTLASS under \${CUDAFORGE_HOME:-~/.cudaforge}: building without flash-attn (candle-flash-attn's build would clone it)"
fi
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-$(nproc)}"

t0=$SECONDS
cargo build "${cargo_flags[@]}" --features "$features" --example llama_longctx --example bench_attention \
  --example bench_memory 2>&1 | tail -3
log "build (--features $features): $((SECONDS - t0)) s"

t0=$SECONDS
cargo test "${cargo_flags[@]}" --features "$features" -p autosp-kernels --test cuda_attention --test cuda_ops \
  -- --nocapture 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "^test |test result|error|max relative" | tail -40
cargo test "${cargo_flags[@]}" --features "$features" --test cuda_state 2>&1 | tee -a "$OUT/cuda_tests.log" \
  | grep -E "^test |test result|error" | tail -10
log "CUDA tests: $((SECONDS - t0)) s"

bin=target/release/examples
export AUTOSP_CACHE="$OUT/cache" HF_HUB_OFFLINE=1
compare() { # compare METRICS_A METRICS_B TOLERANCE WHAT
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
# Step lines only (the file ends with a summary line).
a = [j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j]
b = [j["loss"] for j in map(json.loads, open(sys.argv[2])) if "loss" in j]
tol, what = float(sys.argv[3]), sys.argv[4]
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
ok = len(a) == len(b) and worst <= tol
print(f"gpu_check: {what}: {len(a)} steps, worst relative loss difference {worst:.2e} (tolerance {tol:g}): {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
}
status=0
# One thread rank per GPU (more are refused: thread ranks on one device race, README "Building with CUDA"), so the
# CUDA runs are P = 1 against the CPU's P = 1.
for p in 1; do
  "$bin/llama_longctx" --quick --no-progress --sp "$p" --device cpu --dtype f32 --save "$OUT/cpu$p" \
    --metrics "$OUT/cpu_p$p.jsonl" > "$OUT/cpu_p$p.log"
  for dtype in f32 bf16; do
    "$bin/llama_longctx" --quick --no-progress --sp "$p" --device cuda --dtype "$dtype" --save "$OUT/cuda$p$dtype" \
      --metrics "$OUT/cuda_p${p}_$dtype.jsonl" > "$OUT/cuda_p${p}_$dtype.log"
    tol=1e-4; [ "$dtype" = bf16 ] && tol=2e-2
    compare "$OUT/cuda_p${p}_$dtype.jsonl" "$OUT/cpu_p$p.jsonl" "$tol" "llama_longctx --quick P=$p cuda $dtype vs cpu f32" \
      | tee -a "$OUT/summary.txt" || status=1
  done
done

cuda() { # cuda NAME ARGS...: llama_longctx on CUDA with metrics $OUT/NAME.jsonl and a checkpoint under $OUT/NAME
  local name=$1; shift
  "$bin/llama_longctx" --no-progress --device cuda --save "$OUT/$name" --metrics "$OUT/$name.jsonl" "$@" > "$OUT/$name.log"
}
# Save and resume on CUDA: steps 7-12 of the resumed run must be the uninterrupted run's, bit for bit.
cuda resume_a --quick --dtype bf16 --save-every 6 || status=1
"$bin/llama_longctx" --no-progress --device cuda --quick --dtype bf16 --resume "$OUT/resume_a/step-6" \
  --save "$OUT/resume_b" --metrics "$OUT/resume_b.jsonl" > "$OUT/resume_b.log" || status=1
python3 - "$OUT/resume_a.jsonl" "$OUT/resume_b.jsonl" <<'PY' | tee -a "$OUT/summary.txt" || status=1
import json, sys
a = [j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j]
b = [j["loss"] for j in map(json.loads, open(sys.argv[2])) if "loss" in j]
ok = len(a) == 12 and a[6:] == b
print(f"gpu_check: save at step 6 and resume on CUDA: steps 7-12 {'bit-identical' if ok else 'DIFFER'}: {a[6:]} vs {b}")
sys.exit(0 if ok else 1)
PY
# bf16 and f16 (dynamic loss scaling) against f32, 20 steps on CUDA; host reads per step from the same runs.
for dtype in f32 bf16 f16; do cuda "steps20_$dtype" --quick --steps 20 --dtype "$dtype" || status=1; done
for dtype in bf16 f16; do
  compare "$OUT/steps20_$dtype.jsonl" "$OUT/steps20_f32.jsonl" 2e-2 "llama_longctx --quick --steps 20 cuda $dtype vs cuda f32" \
    | tee -a "$OUT/summary.txt" || status=1
done
python3 - "$OUT"/steps20_*.jsonl <<'PY' | tee -a "$OUT/summary.txt" || status=1
import json, sys
ok = True
for f in sys.argv[1:]:
    lines = [json.loads(l) for l in open(f)]
    reads = [j["host_reads"] for j in lines if "host_reads" in j]
    scale = [j.get("loss_scale") for j in lines if "host_reads" in j]
    good = len(set(reads)) == 1 and reads[0] <= 3
    ok = ok and good
    print(f"gpu_check: {f.split('/')[-1]}: host reads per step {sorted(set(reads))} ({'ok' if good else 'FAILED: not constant or above 3'}); "
          f"loss scale at the end {scale[-1]}")
sys.exit(0 if ok else 1)
PY

"$bin/bench_attention" --device cuda --kernel generic,flash-attn --dtype bf16 --causal --n 16384 --head-dim 64,128 \
  --repeats 3 --naive-max-gib 0 | tee "$OUT/bench_attention_cuda.jsonl" || status=1
for n in 8192 32768; do
  cuda "tput_$n" --seq-len "$n" --curriculum none --steps 6 --warmup 1 || status=1
  grep -E "^\| (throughput|tape peak|device memory|training loss)" "$OUT/tput_$n.log" | sed "s/^/gpu_check: $n tokens: /" \
    | tee -a "$OUT/summary.txt"
done
# Device memory at 8K against the plan's prediction (the tape's peak plus this rank's model states).
"$bin/bench_memory" --device cuda --dtype bf16 --preset bench --n 8192 --steps 2 --checkpoint sequence-aware \
  > "$OUT/bench_memory_cuda.jsonl" || status=1
python3 - "$OUT/bench_memory_cuda.jsonl" <<'PY' | tee -a "$OUT/summary.txt" || status=1
import json, sys
for j in map(json.loads, open(sys.argv[1])):
    if j.get("bench") != "memory":
        continue
    states = j["model_state_bytes_per_rank"]["total"]
    pred = (j["predicted_peak_bytes"] or 0) + states
    dev = j["device_peak_bytes"]
    if dev is None:
        print("gpu_check: bench_memory reported no device peak (the CUDA memory pool could not be read): FAILED")
        sys.exit(1)
    mib = lambda b: b / 2**20
    print(f"gpu_check: bench_memory 8K bf16: device peak {mib(dev):.0f} MiB, predicted (tape peak + model states) "
          f"{mib(pred):.0f} MiB, ratio {dev / pred:.2f}; {j['tokens_per_s']:.0f} tokens/s")
PY
log "done, status $status"
exit $status
