#!/usr/bin/env python3
"""PyTorch's CPU scaled_dot_product_attention, timed like examples/bench_attention.rs, for side-by-side runs.

Optional (needs torch); never part of the tests. Prints one JSON line per N:
  python3 scripts/pytorch_sdpa_bench.py --n 4096,8192 --heads 8 --head-dim 64 --causal
FLOP convention (as bench_attention): forward 4*b*h*N^2*d, halved when causal; forward+backward 3.5x that.
`fwd_cpu_s` / `fwd_bwd_cpu_s`: process CPU seconds per call (all threads), as bench_attention reports them.
`--max-distance W`: a sliding window (query i sees keys j with i - W <= j <= i when causal, |i - j| <= W
otherwise) as a boolean attn_mask, which PyTorch's CPU SDPA applies inside its flash kernel without skipping the
hidden blocks; FLOPs are then counted as for the full (or causal) product, and `mask` says so.
`cpu_capability` is ATen's kernel ISA; `ATEN_CPU_CAPABILITY=avx2` (with MKL_ENABLE_INSTRUCTIONS=AVX2 and
ONEDNN_MAX_CPU_ISA=AVX2) makes an AVX-512 machine stand in for an AVX2-only one.
"""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n", default="4096,8192")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-distance", type=int, default=None, help="sliding window as a boolean attn_mask")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    for n in [int(x) for x in a.n.split(",")]:
        shape = (a.batch, a.heads, n, a.head_dim)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        mask, causal = None, a.causal
        if a.max_distance is not None:
            i = torch.arange(n).unsqueeze(1)
            j = torch.arange(n).unsqueeze(0)
            mask = (i - j <= a.max_distance) & ((j <= i) if a.causal else (j - i <= a.max_distance))
            causal = False

        def fwd():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

        def fwd_bwd():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            o.backward(torch.ones_like(o))

        def median(f):
            """Median wall seconds per call, and the process CPU seconds per call (all threads)."""
            f()
            ts = []
            c0 = time.process_time()
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts), round((time.process_time() - c0) / a.repeats, 3)

        flops = 4 * a.batch * a.heads * n * n * a.head_dim * (0.5 if a.causal else 1.0)
        (f, f_cpu), (fb, fb_cpu) = median(fwd), median(fwd_bwd)
        print(json.dumps({
            "impl": "pytorch_sdpa", "torch": torch.__version__, "threads": a.threads, "batch": a.batch,
            "heads": a.heads, "head_dim": a.head_dim, "n": n, "causal": a.causal, "max_distance": a.max_distance,
            "mask": None if mask is None else "boolean attn_mask (FLOPs counted as without it)",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "fwd_s": f, "fwd_bwd_s": fb, "fwd_cpu_s": f_cpu, "fwd_bwd_cpu_s": fb_cpu, "fwd_gflops": flops / f / 1e9, "fwd_bwd_gflops": 3.5 * flops / fb / 1e9,
        }), flush=True)


if __name__ == "__main__":
    main()
