#!/usr/bin/env python3
"""Compares two safetensors files tensor by tensor (Python's standard library only: CI runs it with no packages).

Both files must hold the same names with the same shapes. Each tensor's largest difference is taken relative
to the reference tensor's largest magnitude (so a gradient whose elements span orders of magnitude is judged
against its scale, as the Rust tests judge gradients); the check fails when any exceeds --rtol. f32, f16 and
bf16 tensors are read; the two files may differ in dtype.

    python3 scripts/compare_safetensors.py ref/grads.safetensors mesh/grads.safetensors --rtol 1e-5

Prints one JSON line {"tensors", "worst", "worst_rel", "rtol"} and exits 1 on a mismatch (naming it).
"""

import argparse
import json
import struct
import sys


def read(path):
    """name -> (shape, list of floats)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = body[start:end]
        dtype = info["dtype"]
        if dtype == "F32":
            values = struct.unpack(f"<{len(raw) // 4}f", raw)
        elif dtype == "F16":
            values = struct.unpack(f"<{len(raw) // 2}e", raw)
        elif dtype == "BF16":
            halves = struct.unpack(f"<{len(raw) // 2}H", raw)
            values = struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves)))
        else:
            sys.exit(f"{path}: tensor {name} has dtype {dtype}; this script reads F32, F16 and BF16")
        out[name] = (info["shape"], values)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--rtol", type=float, required=True, help="largest difference relative to the tensor's scale")
    a = ap.parse_args()
    ref, other = read(a.reference), read(a.other)
    if set(ref) != set(other):
        only = sorted(set(ref) ^ set(other))
        sys.exit(f"the files hold different tensors: {only[:5]} are in one only")
    worst, worst_rel = None, 0.0
    for name, (shape, r) in ref.items():
        oshape, o = other[name]
        if shape != oshape:
            sys.exit(f"{name}: shape {shape} in {a.reference}, {oshape} in {a.other}")
        scale = max((abs(x) for x in r), default=0.0) or 1e-12
        diff = max((abs(x - y) for x, y in zip(r, o)), default=0.0)
        if diff / scale > worst_rel or worst is None:
            worst, worst_rel = name, diff / scale
    print(json.dumps({"tensors": len(ref), "worst": worst, "worst_rel": worst_rel, "rtol": a.rtol}))
    if worst_rel > a.rtol:
        sys.exit(f"{worst}: differs by {worst_rel:.3e} of its scale, above --rtol {a.rtol}")


if __name__ == "__main__":
    main()
