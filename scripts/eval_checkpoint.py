#!/usr/bin/env python3
"""Scores a llama_longctx checkpoint in transformers: the mean next-token loss of token ids, each line of the
ids file a sequence of its own (the windows `--eval-data` scores), the mean over every target.

Loads the checkpoint directory (config.json + model.safetensors, as llama_longctx saves it) with
`AutoModelForCausalLM.from_pretrained` in float32 (a LoRA run's checkpoint, which holds the adapter in PEFT's
layout, loads as `peft.PeftModel.from_pretrained(base, checkpoint)`: the base from --base, else the base model
the adapter names, with the config written beside the adapter, base_config.json, when there is one: the base's
config with the run's RoPE scaling) and computes the loss of the ids in --ids (whitespace-
separated, one window per line: the `heldout-ids.txt` that `--eval-data` writes; an `--eval-tokens` file on
one line is one sequence), with the labels equal to the ids (transformers shifts them: n - 1 targets per line,
the same ones llama_longctx scores).
With --expect (llama_longctx's loss on the same ids: its `--eval-tokens` output) or --metrics (the run's
`--metrics` file: its summary's held-out loss after training, at full precision), prints the difference and
exits 1 when the relative difference is above --rtol.

    python3 scripts/eval_checkpoint.py --checkpoint runs/jargon/step-3 --ids runs/jargon/heldout-ids.txt \\
        --metrics runs/jargon/metrics.jsonl

Prints one JSON line: {"eval_loss", "tokens", "targets", "checkpoint", "seconds", and with --expect:
"expected", "abs_diff", "rel_diff"}.
"""

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a step-N directory written by llama_longctx")
    ap.add_argument("--base", help="for an adapter checkpoint: the base model (default: the adapter's own)")
    ap.add_argument("--ids", required=True, help="whitespace-separated token ids, one sequence per line")
    ap.add_argument("--expect", type=float, help="the loss llama_longctx reported for the same ids")
    ap.add_argument("--metrics", help="llama_longctx's --metrics file: expect its summary's held-out loss after")
    # f32 on both sides; the two differ only in the order of floating-point sums (attention, matmuls, the
    # loss's mean over thousands of tokens), which moves a loss near 3 by about 1e-6 relative.
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference accepted (%(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    if a.metrics:
        lines = [json.loads(l) for l in open(a.metrics) if l.strip()]
        ends = [l["summary"] for l in lines if "summary" in l and l["summary"].get("eval")]
        if not ends:
            sys.exit(f"{a.metrics}: no summary line with a held-out loss (was the run given --eval-data?)")
        a.expect = ends[-1]["eval"]["after"]
    windows = [[int(t) for t in line.split()] for line in open(a.ids) if line.split()]
    if not windows or any(len(w) < 2 for w in windows):
        sys.exit(f"{a.ids}: every line needs at least 2 token ids")
    adapter = os.path.join(a.checkpoint, "adapter_config.json")
    if os.path.exists(adapter):
        from peft import PeftModel

        base = a.base or json.load(open(adapter))["base_model_name_or_path"]
        trained = os.path.join(a.checkpoint, "base_config.json")
        config = AutoConfig.from_pretrained(trained) if os.path.exists(trained) else None
        model = AutoModelForCausalLM.from_pretrained(base, config=config, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, a.checkpoint)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    model.eval()
    t0 = time.time()
    total, targets = 0.0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w], dtype=torch.long)
            total += model(input_ids=x, labels=x).loss.item() * (len(w) - 1)
            targets += len(w) - 1
    loss = total / targets
    out = {
        "eval_loss": loss,
        "tokens": sum(len(w) for w in windows),
        "windows": len(windows),
        "targets": targets,
        "checkpoint": a.checkpoint,
        "seconds": round(time.time() - t0, 1),
    }
    ok = True
    if a.expect is not None:
        diff = abs(loss - a.expect)
        out.update({"expected": a.expect, "abs_diff": diff, "rel_diff": diff / abs(a.expect)})
        ok = diff <= a.rtol * abs(a.expect)
    print(json.dumps(out))
    if not ok:
        sys.exit(f"transformers' loss {loss} differs from the expected {a.expect} by more than rtol {a.rtol}")


if __name__ == "__main__":
    main()
