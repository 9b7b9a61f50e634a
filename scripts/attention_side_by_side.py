#!/usr/bin/env python3
"""Our CPU flash attention and PyTorch's SDPA (or two builds of ours), run in alternation, for figures that
hold on a noisy machine: each round runs every contestant once, one after the other, and the summary gives
the median and the minimum of each one's times, the median of the per-round ratios against the first
contestant and the ratio of the minima (the least disturbed runs: other processes only ever add time).

Optional (needs torch for the PyTorch contestant); never part of the tests. One JSON line per round and
contestant, then one summary line:

  python3 scripts/attention_side_by_side.py --ours target/release/examples/bench_attention --torch \\
      --n 8192 --head-dim 64 --causal --threads 2 --rounds 3 --simd avx2

`--simd avx2` also forces PyTorch onto AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA): the AVX2 stand-in on an AVX-512 machine. `--ours LABEL=PATH` may be given more than
once (a build before and after a change); the ratios are against `--reference` (default: the first).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(out):
    """The last JSON object line of a benchmark's output."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"no JSON line in the output:\n{out}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", action="append", default=[], help="bench_attention binary, or LABEL=PATH")
    ap.add_argument("--torch", action="store_true", help="also run scripts/pytorch_sdpa_bench.py")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--max-distance", type=int, default=None, help="sliding window (both contestants)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per run (each run reports their median)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference", default=None, help="the contestant the ratios are against (default: the first)")
    ap.add_argument("--simd", default=None, help="our vector path (avx2 also forces PyTorch onto AVX2)")
    a = ap.parse_args()
    if not a.ours and not a.torch:
        raise SystemExit("give --ours PATH and/or --torch")

    common = ["--n", str(a.n), "--head-dim", str(a.head_dim), "--heads", str(a.heads), "--threads", str(a.threads),
              "--repeats", str(a.repeats)] + (["--causal"] if a.causal else [])
    window = ["--max-distance", str(a.max_distance)] if a.max_distance is not None else []
    contestants = []
    for spec in a.ours:
        label, _, path = spec.rpartition("=")
        cmd = [path] + common + window + ["--naive-max-gib", "0"] + (["--simd", a.simd] if a.simd else [])
        contestants.append((label or "autosp", cmd, dict(os.environ)))
    if a.torch:
        env = dict(os.environ)
        if a.simd == "avx2":
            env.update(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
        cmd = [sys.executable, os.path.join(HERE, "pytorch_sdpa_bench.py"), "--n", str(a.n), "--head-dim",
               str(a.head_dim), "--heads", str(a.heads), "--threads", str(a.threads), "--repeats", str(a.repeats)]
        contestants.append(("pytorch", cmd + (["--causal"] if a.causal else []) + window, env))

    times = {label: {"fwd_s": [], "fwd_bwd_s": []} for label, _, _ in contestants}
    ref = a.reference or contestants[0][0]
    if ref not in times:
        raise SystemExit(f"--reference {ref}: no such contestant ({', '.join(times)})")
    for rnd in range(a.rounds):
        for label, cmd, env in contestants:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"{label} failed ({run.returncode}):\n{run.stderr}")
            line = last_json(run.stdout)
            for key in ("fwd_s", "fwd_bwd_s"):
                times[label][key].append(line[key])
            print(json.dumps({"round": rnd, "contestant": label, "fwd_s": line["fwd_s"],
                              "fwd_bwd_s": line["fwd_bwd_s"]}), flush=True)

    summary = {"n": a.n, "head_dim": a.head_dim, "heads": a.heads, "causal": a.causal,
               "max_distance": a.max_distance, "threads": a.threads,
               "simd": a.simd, "rounds": a.rounds, "repeats": a.repeats, "reference": ref}
    for label in times:
        for key, ts in times[label].items():
            summary[f"{label}_{key}"] = round(statistics.median(ts), 4)
            summary[f"{label}_{key}_min"] = round(min(ts), 4)
            if label != ref:
                ratios = [t / r for t, r in zip(ts, times[ref][key])]
                summary[f"{label}_over_{ref}_{key}"] = round(statistics.median(ratios), 3)
                summary[f"{label}_over_{ref}_{key}_of_mins"] = round(min(ts) / min(times[ref][key]), 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
