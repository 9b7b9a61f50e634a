#!/usr/bin/env python3
"""Markdown tables from scripts/extend_context.sh's outputs (docs/BENCHMARKS.md "Extending a model's context").

Usage: python3 scripts/extend_context_tables.py [OUT]   (OUT: the script's directory, default target/extend-context)

Reads ARM/positions.jsonl and ARM/passkey.jsonl ({"eval": "positions"|"passkey", ...} lines written by
llama_longctx --metrics) for the arms a, b and c-seedN, and c-seedN/train.jsonl (step lines, summary); prints the
loss by position per arm (with the spread of the c seeds), the passkey grid per arm, and the training cost.
Missing files are reported as not run yet.
"""
import json
import pathlib
import sys

ARMS = {"a": "(a) as it is", "b": "(b) YaRN, no training"}
LENGTH = 16384  # tokens per step (--seq-len, one sequence a step)


def lines(path):
    if not path.is_file():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def arms(out):
    found = [a for a in ("a", "b") if (out / a).is_dir()]
    found += sorted(p.name for p in out.glob("c-seed*") if p.is_dir())
    return found


def label(arm):
    return ARMS.get(arm, f"(c) YaRN + LoRA, seed {arm.removeprefix('c-seed')}")


def positions(out):
    rows, buckets = {}, []
    for arm in arms(out):
        cells = [l for l in lines(out / arm / "positions.jsonl") if l.get("eval") == "positions"]
        if not cells:
            continue
        # An evaluation-only run scores once (before); take the last scoring of each bucket.
        by = {}
        for c in cells:
            by[(c["from"], c["to"])] = c
        rows[arm] = by
        for k in by:
            if k not in buckets:
                buckets.append(k)
    if not rows:
        print("loss by position: not run yet\n")
        return
    buckets.sort()
    head = "| arm | " + " | ".join(f"{a}-{b}" for a, b in buckets) + " |"
    print("Held-out loss by token position (mean next-token loss in each bucket of positions):\n")
    print(head)
    print("|" + "---|" * (len(buckets) + 1))
    for arm, by in rows.items():
        cells = [f"{by[k]['loss']:.4f}" if k in by else "" for k in buckets]
        print(f"| {label(arm)} | " + " | ".join(cells) + " |")
    seeds = [by for arm, by in rows.items() if arm.startswith("c-seed")]
    if len(seeds) >= 2:
        cells = []
        for k in buckets:
            v = [by[k]["loss"] for by in seeds if k in by]
            cells.append(f"{(sum(v) / len(v)):.4f} ± {(max(v) - min(v)) / 2:.4f}" if v else "")
        print("| (c) mean ± half the range of the seeds | " + " | ".join(cells) + " |")
    first = next(iter(rows.values()))
    print("\ntargets per bucket: " + ", ".join(f"{a}-{b}: {first[(a, b)]['targets']}" for a, b in buckets
                                              if (a, b) in first) + "\n")


def passkey(out):
    any_run = False
    for arm in arms(out):
        cells = [l for l in lines(out / arm / "passkey.jsonl") if l.get("eval") == "passkey"]
        if not cells:
            continue
        any_run = True
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        grid = {(c["length"], c["depth"]): c for c in cells}
        print(f"Passkey, {label(arm)} (hits / samples; rows: length in tokens, columns: depth in %):\n")
        print("| length | " + " | ".join(f"{d}%" for d in depths) + " | all |")
        print("|" + "---|" * (len(depths) + 2))
        for n in lengths:
            row = [grid.get((n, d)) for d in depths]
            hits = sum(c["hits"] for c in row if c)
            total = sum(c["samples"] for c in row if c)
            print(f"| {n} | " + " | ".join(f"{c['hits']}/{c['samples']}" if c else "" for c in row)
                  + f" | {100 * hits / max(total, 1):.0f}% |")
        print()
    if not any_run:
        print("passkey grid: not run yet\n")


def training(out):
    print("Training (arm c):\n")
    print("| seed | steps | first loss | last loss | s/step | tokens/s | process peak |")
    print("|---|---|---|---|---|---|---|")
    for arm in arms(out):
        if not arm.startswith("c-seed"):
            continue
        ls = lines(out / arm / "train.jsonl")
        # A training resumed across sittings appends: a step logged twice (stopped before its save) counts once,
        # the last time; its seconds come from each step's own tokens/s.
        by_step = {l["step"]: l for l in ls if "loss" in l and "step" in l and "summary" not in l}
        steps = [by_step[k] for k in sorted(by_step)]
        summary = next((l["summary"] for l in reversed(ls) if "summary" in l), None)
        if not steps or not summary:
            print(f"| {arm.removeprefix('c-seed')} | not finished | | | | | |")
            continue
        secs = sum(l.get("tokens", LENGTH) / l["tokens_per_s"] for l in steps if l.get("tokens_per_s"))
        def bytes_of(v):  # one figure, or one per rank
            return max(v) if isinstance(v, list) else (v or 0)
        peak = max(bytes_of(s.get("process_peak_bytes")) for s in steps)
        print(f"| {arm.removeprefix('c-seed')} | {len(steps)} | {steps[0]['loss']:.4f} | {steps[-1]['loss']:.4f} | "
              f"{secs / len(steps):.0f} | {LENGTH * len(steps) / max(secs, 1e-9):.0f} | {peak / 2**30:.1f} GiB |")
    print()


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/extend-context")
    if not out.is_dir():
        sys.exit(f"{out}: no such directory (run scripts/extend_context.sh first)")
    positions(out)
    passkey(out)
    training(out)


if __name__ == "__main__":
    main()
