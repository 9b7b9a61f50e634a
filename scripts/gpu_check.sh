#!/usr/bin/env bash
# The first run on a CUDA GPU, in minutes: every check autosp has for a GPU, each stage printing PASS, FAIL or
# SKIP (with the reason) and the script going on after a failure, ending with a table of all stages. Exits 1
# when a stage failed.
#
#   scripts/gpu_check.sh --bundle DIR        on the GPU machine: runs a bundle built beforehand on any machine
#                                            by scripts/gpu_bundle.sh (no cargo, no nvcc, no build); about 5
#                                            minutes on an H100 (8 at most).
#   scripts/gpu_check.sh                     the same after building the bundle here (scripts/gpu_bundle.sh:
#                                            network to PyPI the first time, 15+ minutes cold on 2 cores).
#   scripts/gpu_check.sh --device cpu        the CPU dry run (CI runs it; under 3 minutes on 2 cores): every
#                                            stage's host half, on the CPU, with small sizes: the binaries of
#                                            target/release (or --bundle's), the scripts' parsing and
#                                            comparisons, the error a CUDA request gets here. Stages that need a
#                                            GPU SKIP with the reason; every other stage must PASS.
#
# Stages (cuda: what runs on the GPU; cpu: the dry run's host half):
#   versions    the GPU, driver and the CUDA version it supports against the toolkit the bundle was built with
#               (the driver JIT-compiles candle's PTX and refuses PTX newer than itself), and where each CUDA
#               library comes from (bundle/run --libs). cpu: the binaries and the bundle's manifest.
#   no_device   cpu only: `llama_longctx --device cuda` fails with autosp's own error (a bundle: "no CUDA
#               device"; a CPU build: "built without CUDA"), not a loader error.
#   cuda_tests  the CUDA test binaries (cuda_attention, cuda_ops: the generic kernels on CUDA against the CPU
#               kernels, forward and backward, f32 and bf16; cuda_state). cpu: SKIP.
#   grads       examples/grad_compare: per-tensor gradients of one step of the bench model shape (4 layers,
#               hidden 512) at 2048 and 4096 tokens, CUDA in f32 (1e-4) and bf16 (3e-2) against the CPU in f32
#               with the generic kernels forced. cpu: 2 layers at 512 tokens, the CPU's fast kernels against
#               the generic ones.
#   losses      llama_longctx --quick (12 steps) on the device in f32 and bf16 against the CPU in f32, every
#               step's loss (1e-4, 2e-2). cpu: the CPU in f32 with the generic kernels forced as the reference.
#   resume      save at step 6 and resume: steps 7-12 equal the uninterrupted run's bit for bit (bf16).
#   precision   20 steps in f32, bf16 and f16 (dynamic loss scaling): bf16/f16 losses within 2e-2 of f32; host
#               reads per step the same on every step and at most 3. cpu: 6 steps, the generic kernels forced.
#   attention   bench_attention, generic attention forward and forward+backward (bf16, causal, N = 16384,
#               head_dim 64 and 128; timings after a warm-up). cpu: f32, N = 1024, head_dim 64.
#   sdpa        PyTorch's scaled_dot_product_attention on the same device, shapes and dtype, forward and
#               forward+backward, beside our attention's times (when python3 has torch; SKIP otherwise).
#   train       llama_longctx tokens/s at 8192 tokens, 6 steps: the median of steps 3-6 (steps 1-2, with the
#               PTX JIT and the allocator warming up, excluded). cpu: 1024 tokens.
#   memory      bench_memory on the bench shape at 8192 and 32768 tokens (bf16, sequence-aware): tokens/s of
#               the measured step (after a warm-up step) and the device-memory peak against the plan's
#               prediction (tape peak + model states). cpu: 1024 tokens, the process peak.
#   nccl        tests/nccl_overlap on two GPUs (a group and its duplicate at once, gradients with the
#               communication threads over NCCL), one test at a time. SKIP with fewer than two GPUs.
#
# Each stage has its own time limit, and the whole run a budget (GPU_CHECK_BUDGET_S, default 460 s, inside the 8
# minutes a first run may take after unpacking): a stage that would start past it SKIPs, saying so.
# Results go to $GPU_CHECK_OUT (default target/gpu_check): one log per stage, summary.txt (the table).
set -uo pipefail
cd "$(dirname "$0")/.."

bundle="" device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (use --bundle DIR, --device cuda|cpu)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "gpu_check: --device $device: use cuda or cpu" >&2; exit 2 ;; esac
OUT="${GPU_CHECK_OUT:-target/gpu_check}"
rm -rf "$OUT"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export AUTOSP_CACHE="$OUT/cache" HF_HUB_OFFLINE=1
start=$SECONDS

if [ "$device" = cuda ] && [ -z "$bundle" ]; then
  scripts/gpu_bundle.sh target/gpu-bundle || { echo "gpu_check: building the bundle failed" >&2; exit 1; }
  bundle=target/gpu-bundle
fi
if [ -n "$bundle" ]; then
  bundle="$(cd "$bundle" && pwd)"
  if [ ! -x "$bundle/run" ] && [ -f "$bundle/autosp-gpu-bundle.tar.xz" ]; then
    unpacked="${TMPDIR:-/tmp}/autosp-gpu-bundle"
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    t0=$SECONDS
    if command -v xz >/dev/null; then
      tar -C "$unpacked" -xJf "$bundle/autosp-gpu-bundle.tar.xz"
    else
      python3 - "$bundle/autosp-gpu-bundle.tar.xz" "$unpacked" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    try:
        t.extractall(sys.argv[2], filter="data")
    except TypeError:  # a Python without extraction filters
        t.extractall(sys.argv[2])
PY
    fi
    echo "gpu_check: unpacked $bundle/autosp-gpu-bundle.tar.xz into $unpacked ($((SECONDS - t0)) s)"
    bundle="$unpacked"
  fi
  [ -x "$bundle/run" ] || { echo "gpu_check: $bundle is not a bundle (no run, no autosp-gpu-bundle.tar.xz): scripts/gpu_bundle.sh makes one" >&2; exit 2; }
  bin() { "$bundle/run" "$@"; }
  has_bin() { [ -x "$bundle/bin/$1" ]; }
else
  examples="${CARGO_TARGET_DIR:-target}/release/examples"
  bin() { local b=$1; shift; "$examples/$b" "$@"; }
  has_bin() { [ -x "$examples/$1" ]; }
fi
cpu_dry() { [ "$device" = cpu ]; }
start=$SECONDS  # the budget below counts from here: a build or an unpack above is not in it

# --- the stage runner: each stage is a function run in a subshell, its output in $OUT/NAME.log; exit 0 is
# PASS, 77 SKIP (the reason: the last line it printed), anything else FAIL. A stage prints its findings as lines
# starting with "> ", which go to the terminal and the table's note. ---
names=() results=() times=() notes=()
budget=${GPU_CHECK_BUDGET_S:-460}
stage() { # stage NAME TIMEOUT_S FUNCTION
  local name=$1 limit=$2 fn=$3 t0=$SECONDS rc result note left
  echo "gpu_check: --- $name"
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 10 ]; then
    # On a GPU the stages left SKIP; the dry run's host stages must all run, so there it is a failure.
    echo "> the run's budget of $budget s is spent (GPU_CHECK_BUDGET_S)" > "$OUT/$name.log"
    rc=77
    cpu_dry && rc=1
  else
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" bash -c "set -euo pipefail; $fn" > "$OUT/$name.log" 2>&1
    rc=$?
  fi
  case $rc in
    0) result=PASS ;;
    77) result=SKIP ;;
    124) result=FAIL; echo "> timed out after $limit s" >> "$OUT/$name.log" ;;
    *) result=FAIL ;;
  esac
  grep '^> ' "$OUT/$name.log" | sed "s/^> /gpu_check: $name: /"
  if [ "$result" = FAIL ] && ! grep -q '^> ' "$OUT/$name.log"; then
    tail -n 5 "$OUT/$name.log" | sed "s/^/gpu_check: $name: | /"
  fi
  if [ "$result" = SKIP ]; then
    note="$(tail -n 1 "$OUT/$name.log" | sed 's/^> //' | cut -c1-110)"
    grep -q '^> ' "$OUT/$name.log" || echo "gpu_check: $name: $note"
  else
    note="$(grep '^> ' "$OUT/$name.log" | tail -n 1 | sed 's/^> //' | cut -c1-110)"
  fi
  [ "$result" = FAIL ] && [ -z "$note" ] && note="exit $rc; see $name.log"
  echo "gpu_check: [$result] $name ($((SECONDS - t0)) s)"
  names+=("$name") results+=("$result") times+=("$((SECONDS - t0))") notes+=("$note")
}
export OUT device bundle examples=${examples:-}

# compare_losses A.jsonl B.jsonl TOLERANCE WHAT: every step's loss of A within TOLERANCE (relative) of B's.
compare_losses() {
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
a = [j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j and "summary" not in j]
b = [j["loss"] for j in map(json.loads, open(sys.argv[2])) if "loss" in j and "summary" not in j]
tol, what = float(sys.argv[3]), sys.argv[4]
worst = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf"))
ok = len(a) == len(b) > 0 and worst <= tol
print(f"> {what}: {len(a)} steps, worst relative loss difference {worst:.2e} (tolerance {tol:g}): {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
}

st_versions() {
  if [ -n "$bundle" ]; then
    head -n 3 "$bundle/MANIFEST"
    echo "> bundle: $(sed -n 2p "$bundle/MANIFEST" | cut -c1-100)"
    "$bundle/run" --libs
  fi
  for b in llama_longctx bench_attention bench_memory grad_compare; do
    has_bin "$b" || { echo "> binary $b missing (CPU: cargo build --release --examples; GPU: scripts/gpu_bundle.sh)"; exit 1; }
  done
  if cpu_dry; then
    echo "> binaries present; $(command -v nvidia-smi >/dev/null && echo "nvidia-smi present" || echo "no nvidia-smi: no driver here (cpu dry run)")"
    return 0
  fi
  command -v nvidia-smi >/dev/null || { echo "> nvidia-smi not found: this needs an NVIDIA GPU and its driver"; exit 1; }
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
  local driver_cuda built
  driver_cuda="$(nvidia-smi | sed -nE 's/.*CUDA Version: ([0-9]+\.[0-9]+).*/\1/p' | head -1)"
  built="$(sed -nE 's/.*(release |cuda_)([0-9]+\.[0-9]+).*/\2/p' "$bundle/MANIFEST" | head -1)"
  echo "> $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -1); driver CUDA $driver_cuda; bundle's toolkit $built; $(nvidia-smi -L | wc -l) GPU(s)"
  if "$bundle/run" --libs | grep -q STUB; then
    echo "> a CUDA library was not found (see the log: run --libs): install the toolkit or PyTorch's nvidia-* wheels"
    exit 1
  fi
  if [ -n "$driver_cuda" ] && [ -n "$built" ] && [ "$(printf '%s\n' "$built" "$driver_cuda" | sort -V | tail -1)" != "$driver_cuda" ]; then
    echo "> the driver supports CUDA $driver_cuda, older than the bundle's toolkit $built: its PTX will not load; rebuild the bundle with an older toolkit"
    exit 1
  fi
}

st_no_device() {
  cpu_dry || { echo "a GPU is present (this stage checks the error where there is none)"; exit 77; }
  local log="$OUT/no_device.out" rc=0
  bin llama_longctx --device cuda --quick --no-progress > "$log" 2>&1 || rc=$?
  cat "$log"
  if [ "$rc" -eq 0 ]; then echo "> llama_longctx --device cuda ran on a machine without a GPU"; exit 1; fi
  if grep -qiE "error while loading shared libraries|cannot open shared object" "$log"; then
    echo "> a loader error, not autosp's: $(grep -iE 'shared' "$log" | head -1)"; exit 1
  fi
  if grep -q "no CUDA device" "$log" || grep -q "built without CUDA" "$log"; then
    echo "> --device cuda here: $(grep -oE '(no CUDA device[^:]*|this binary was built without CUDA)' "$log" | head -1) (exit $rc)"
  else
    echo "> unexpected error: $(tail -1 "$log")"; exit 1
  fi
}

st_cuda_tests() {
  cpu_dry && { echo "needs a GPU (the CUDA tests compare CUDA with the CPU)"; exit 77; }
  local t failed=0
  for t in cuda_attention cuda_ops cuda_state; do
    if bin "$t" --nocapture > "$OUT/test_$t.log" 2>&1; then
      echo "> $t: $(grep -E '^test result' "$OUT/test_$t.log" | tail -1)"
    else
      failed=1
      echo "> $t FAILED: $(grep -E '^test .*FAILED|panicked' "$OUT/test_$t.log" | head -3 | tr '\n' ' ')"
    fi
  done
  exit $failed
}

st_grads() {
  local args=(--device cuda --n 2048,4096 --dtype f32,bf16)
  cpu_dry && args=(--device cpu --n 512 --layers 2 --dtype f32,bf16)
  local rc=0
  bin grad_compare "${args[@]}" > "$OUT/grads.jsonl" || rc=$?
  python3 - "$OUT/grads.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for j in lines:
    print(f"> n {j['n']} {j['dtype']}: {j['tensors']} tensors, worst {j['worst']} {j['worst_rel']:.2e} (tolerance {j['rtol']:g}), "
          f"loss {j['loss']:.6f} vs {j['loss_reference']:.6f}: {'ok' if j['pass'] else 'FAILED'}")
sys.exit(0 if lines and all(j["pass"] for j in lines) else 1)
PY
  [ "$rc" -eq 0 ]
}

st_losses() {
  local dev=cuda
  cpu_dry && dev=cpu
  # The reference: the CPU in f32 (in the dry run with the generic kernels forced, against the fast ones).
  AUTOSP_KERNELS="$(cpu_dry && echo generic || echo auto)" bin llama_longctx --quick --no-progress --sp 1 \
    --device cpu --dtype f32 --metrics "$OUT/losses_cpu.jsonl" > "$OUT/losses_cpu.log"
  local dtype tol ok=0
  for dtype in f32 bf16; do
    tol=1e-4; [ "$dtype" = bf16 ] && tol=2e-2
    bin llama_longctx --quick --no-progress --sp 1 --device "$dev" --dtype "$dtype" \
      --metrics "$OUT/losses_$dtype.jsonl" > "$OUT/losses_$dtype.log"
    compare_losses "$OUT/losses_$dtype.jsonl" "$OUT/losses_cpu.jsonl" "$tol" "--quick $dev $dtype vs cpu f32" || ok=1
  done
  exit $ok
}

st_resume() {
  local dev=cuda
  cpu_dry && dev=cpu
  bin llama_longctx --quick --no-progress --sp 1 --device "$dev" --dtype bf16 --save "$OUT/resume_a" \
    --save-every 6 --metrics "$OUT/resume_a.jsonl" > "$OUT/resume_a.log"
  bin llama_longctx --quick --no-progress --sp 1 --device "$dev" --dtype bf16 --resume "$OUT/resume_a/step-6" \
    --save "$OUT/resume_b" --metrics "$OUT/resume_b.jsonl" > "$OUT/resume_b.log"
  python3 - "$OUT/resume_a.jsonl" "$OUT/resume_b.jsonl" <<'PY'
import json, sys
a = [j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j and "summary" not in j]
b = [j["loss"] for j in map(json.loads, open(sys.argv[2])) if "loss" in j and "summary" not in j]
ok = len(a) == 12 and a[6:] == b
print(f"> save at step 6, resume: steps 7-12 {'bit-identical' if ok else 'DIFFER'} ({len(b)} steps resumed)")
sys.exit(0 if ok else 1)
PY
}

st_precision() {
  local dev=cuda steps=20 dtype ok=0
  # The dry run forces the generic kernels (a GPU's): the CPU's fast bf16 path reads the host once more a step.
  cpu_dry && { dev=cpu; steps=6; export AUTOSP_KERNELS=generic; }
  for dtype in f32 bf16 f16; do
    bin llama_longctx --quick --steps "$steps" --no-progress --sp 1 --device "$dev" --dtype "$dtype" \
      --metrics "$OUT/precision_$dtype.jsonl" > "$OUT/precision_$dtype.log"
  done
  for dtype in bf16 f16; do
    compare_losses "$OUT/precision_$dtype.jsonl" "$OUT/precision_f32.jsonl" 2e-2 "$steps steps $dev $dtype vs $dev f32" || ok=1
  done
  python3 - "$OUT"/precision_*.jsonl <<'PY' || ok=1
import json, sys
ok = True
for f in sys.argv[1:]:
    lines = [json.loads(l) for l in open(f)]
    reads = [j["host_reads"] for j in lines if "host_reads" in j]
    scale = [j.get("loss_scale") for j in lines if "host_reads" in j]
    good = bool(reads) and len(set(reads)) == 1 and reads[0] <= 3
    ok = ok and good
    print(f"> {f.split('/')[-1]}: host reads per step {sorted(set(reads))} ({'ok' if good else 'FAILED: not constant or above 3'}); loss scale at the end {scale[-1] if scale else None}")
sys.exit(0 if ok else 1)
PY
  exit $ok
}

attention_args() { # the shapes of the attention and sdpa stages
  if cpu_dry; then echo "--device cpu --dtype f32 --n 1024 --head-dim 64"; else echo "--device cuda --dtype bf16 --n 16384 --head-dim 64,128"; fi
}

st_attention() {
  # shellcheck disable=SC2046
  bin bench_attention --kernel generic --causal --repeats 3 --naive-max-gib 0 $(attention_args) > "$OUT/attention.jsonl"
  python3 - "$OUT/attention.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for j in lines:
    print(f"> ours (generic) N={j['n']} d={j['head_dim']} {j['dtype']}: fwd {j['generic_fwd_s']*1e3:.2f} ms, "
          f"fwd+bwd {j['generic_fwd_bwd_s']*1e3:.2f} ms ({j['generic_fwd_bwd_gflops']:.0f} GFLOP/s)")
sys.exit(0 if lines else 1)
PY
}

st_sdpa() {
  python3 -c "import torch" 2>/dev/null || { echo "python3 has no torch: no PyTorch baseline"; exit 77; }
  if ! cpu_dry && ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch sees no CUDA device"; exit 77
  fi
  # shellcheck disable=SC2046
  python3 - "$OUT/attention.jsonl" $(attention_args) <<'PY'
import json, statistics, sys, time
import torch
import torch.nn.functional as F
ours_file, rest = sys.argv[1], sys.argv[2:]
opt = dict(zip(rest[::2], rest[1::2]))
dev = opt["--device"]
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[opt["--dtype"]]
n = int(opt["--n"])
ours = {}
try:
    for l in open(ours_file):
        if l.startswith("{"):
            j = json.loads(l)
            ours[(j["n"], j["head_dim"])] = j
except FileNotFoundError:
    pass
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
def timed(f, repeats=3):
    f(); sync()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); f(); sync(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
torch.manual_seed(0)
for d in [int(x) for x in opt["--head-dim"].split(",")]:
    q, k, v = (torch.randn(1, 8, n, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    fwd_bwd = timed(fb)
    line = {"bench": "sdpa", "torch": torch.__version__, "device": dev, "n": n, "head_dim": d, "heads": 8,
            "dtype": opt["--dtype"], "fwd_s": fwd, "fwd_bwd_s": fwd_bwd}
    o = ours.get((n, d))
    note = ""
    if o:
        line["ours_over_sdpa_fwd"] = o["generic_fwd_s"] / fwd
        line["ours_over_sdpa_fwd_bwd"] = o["generic_fwd_bwd_s"] / fwd_bwd
        note = f"; ours/SDPA: fwd {line['ours_over_sdpa_fwd']:.2f}x, fwd+bwd {line['ours_over_sdpa_fwd_bwd']:.2f}x"
    print(json.dumps(line))
    print(f"> torch {torch.__version__} SDPA N={n} d={d} {opt['--dtype']} on {dev}: fwd {fwd*1e3:.2f} ms, fwd+bwd {fwd_bwd*1e3:.2f} ms{note}")
PY
}

st_train() {
  local dev=cuda n=8192
  cpu_dry && { dev=cpu; n=1024; }
  bin llama_longctx --no-progress --sp 1 --device "$dev" --seq-len "$n" --curriculum none --steps 6 --warmup 1 \
    --metrics "$OUT/train.jsonl" > "$OUT/train.log"
  python3 - "$OUT/train.jsonl" "$n" "$dev" <<'PY'
import json, statistics, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in j and "step" in j and "summary" not in j]
later = [j["tokens_per_s"] for j in steps[2:] if j["tokens_per_s"]]
first = [round(j["tokens_per_s"] or 0) for j in steps[:2]]
if not later:
    print("> no step after the first two reported tokens/s"); sys.exit(1)
peak = max((j.get("device_peak_bytes") or 0) for j in steps)
print(f"> llama_longctx {sys.argv[2]} tokens on {sys.argv[3]}: {statistics.median(later):.0f} tokens/s (median of steps 3-{len(steps)}; "
      f"steps 1-2: {first}){f', device peak {peak / 2**20:.0f} MiB' if peak else ''}")
PY
}

st_memory() {
  local args=(--device cuda --dtype bf16 --n 8192,32768)
  cpu_dry && args=(--device cpu --dtype f32 --n 1024)
  bin bench_memory --preset bench --steps 2 --checkpoint sequence-aware "${args[@]}" > "$OUT/memory.jsonl"
  python3 - "$OUT/memory.jsonl" "$device" <<'PY'
import json, sys
mib = lambda b: b / 2**20
ok, seen = True, 0
for j in map(json.loads, (l for l in open(sys.argv[1]) if l.startswith("{"))):
    if j.get("bench") != "memory":
        continue
    seen += 1
    pred = (j["predicted_peak_bytes"] or 0) + j["model_state_bytes_per_rank"]["total"]
    if sys.argv[2] == "cuda":
        dev = j["device_peak_bytes"]
        if dev is None:
            print(f"> N={j['n']}: no device peak (the CUDA memory pool could not be read)"); ok = False; continue
        print(f"> bench N={j['n']} bf16: {j['tokens_per_s']:.0f} tokens/s; device peak {mib(dev):.0f} MiB, "
              f"predicted (tape peak + model states) {mib(pred):.0f} MiB, ratio {dev / pred:.2f}")
    else:
        print(f"> bench N={j['n']} on the CPU: {j['tokens_per_s']:.0f} tokens/s; process peak {mib(j['process_peak_bytes']):.0f} MiB, "
              f"predicted tape peak + model states {mib(pred):.0f} MiB")
sys.exit(0 if ok and seen else 1)
PY
}

st_nccl() {
  cpu_dry && { echo "NCCL needs two GPUs (cpu dry run)"; exit 77; }
  local gpus
  gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
  [ "$gpus" -ge 2 ] || { echo "$gpus GPU(s): the NCCL collectives need two"; exit 77; }
  has_bin nccl_overlap || { echo "no nccl_overlap binary (scripts/gpu_bundle.sh builds it)"; exit 77; }
  if bin nccl_overlap --test-threads=1 --nocapture > "$OUT/test_nccl_overlap.log" 2>&1; then
    echo "> nccl_overlap ($gpus GPUs): $(grep -E '^test result' "$OUT/test_nccl_overlap.log" | tail -1)"
  else
    echo "> nccl_overlap FAILED: $(grep -E '^test .*FAILED|panicked' "$OUT/test_nccl_overlap.log" | head -3 | tr '\n' ' ')"
    exit 1
  fi
}

if cpu_dry; then echo "gpu_check: CPU dry run (--device cpu): the host half of every stage"; fi
export -f bin has_bin cpu_dry compare_losses attention_args $(declare -F | awk '$3 ~ /^st_/ { print $3 }')
stage versions 30 st_versions
stage no_device 30 st_no_device
stage cuda_tests 150 st_cuda_tests
stage grads 150 st_grads
stage losses 90 st_losses
stage resume 60 st_resume
stage precision 90 st_precision
stage attention 60 st_attention
stage sdpa 60 st_sdpa
stage train 90 st_train
stage memory 120 st_memory
stage nccl 120 st_nccl

failed=0
for r in "${results[@]}"; do [ "$r" = FAIL ] && failed=1; done
{
  echo
  echo "| stage | result | seconds | note |"
  echo "|---|---|---|---|"
  for i in "${!names[@]}"; do
    echo "| ${names[$i]} | ${results[$i]} | ${times[$i]} | ${notes[$i]//|/\\|} |"
  done
  echo
  echo "gpu_check ($device${bundle:+, bundle $bundle}): $((SECONDS - start)) s, $( [ $failed = 0 ] && echo "no stage failed" || echo "FAILED")"
} | tee "$OUT/summary.txt"
exit $failed
