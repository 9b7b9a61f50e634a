"""The PyTorch reference for bench_memory: HF transformers' LlamaForCausalLM with the `bench` preset
(vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads, 4 kv heads, untied, rope_theta 10000, f32),
SDPA attention, AdamW, on the CPU; one JSON line per run with the step time and the process's peak RSS.
Optional (needs torch and transformers); never part of the tests.

    /work/venv-golden/bin/python scripts/pytorch_bench.py --n 8192 [--checkpoint] [--steps 1]

Peak RSS (ru_maxrss) covers the whole process since it started (weights, AdamW moments, activations and the
allocator's cached blocks), like the tracking allocator's process peak in bench_memory but also counting
the Python runtime and torch's libraries.

Context capacity, like `bench_memory --capacity`: each N (and each gradient-checkpointing setting) runs in a
fresh subprocess, so each peak RSS is that run's own; then one `"bench":"capacity"` line per setting with the
least-squares line peak = a + b*N through the runs, its RMSE, largest relative residual and R^2, and the
longest multiple of --capacity-multiple whose fitted peak fits --budget (with --confirm, one more run there):

    /work/venv-golden/bin/python scripts/pytorch_bench.py --n 2048,3072,4096 --gradient-checkpointing off,on \
        --capacity --budget 4Gi [--confirm]

As in bench_memory, two or more points within 0.1% of the smallest peak are a flat floor, left out of the fit.
PyTorch's peak grows faster than linearly (without checkpointing, the RSS at N = 8192, 7.27 GB, is 19% above
the line through N = 512 and 1024), so measure at lengths close to the capacity and confirm. Peak RSS varies
by about 10 MB between identical runs.
"""

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time


def op_kind(name):
    """The kind of a torch op, for the profile's groups (as bench_memory's `op_kind`)."""
    n = name.lower()
    if "attention" in n or "sdpa" in n or "softmax" in n and "log_softmax" not in n:
        return "attention"
    if any(k in n for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")):
        return "matmuls"
    if any(k in n for k in ("cross_entropy", "log_softmax", "nll_loss")):
        return "loss"
    if any(k in n for k in ("pow", "rsqrt", "mean", "norm", "silu", "sigmoid", "rotary", "cos", "sin", "neg")):
        return "norm, rope, swiglu"
    if any(k in n for k in ("embedding",)):
        return "embedding"
    return "other"


def profile_step(forward_backward, optimizer):
    """Runs `forward_backward()` under torch.profiler (CPU) and then times `optimizer()` (the optimizer's own
    elementwise ops would otherwise mix with the model's); returns the self CPU seconds of every op that took at
    least a millisecond, and their sums by kind. Self time: an op's time without the ops it called (an autograd
    node's `MmBackward0` counts only its own bookkeeping; its `aten::mm` counts as a matmul)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward()
    t0 = time.perf_counter()
    optimizer()
    ops, kinds = [], {"optimizer": time.perf_counter() - t0}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        kind = op_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + s
        if s >= 1e-3:
            ops.append({"op": e.key, "kind": kind, "self_s": s, "calls": e.count})
    ops.sort(key=lambda o: -o["self_s"])
    return {"by_kind_s": kinds, "ops": ops, "covered_s": sum(kinds.values()),
            "scope": "torch.profiler, the last measured step, self CPU time of each op on the calling thread"}


def run_one(n, gradient_checkpointing, steps, profiled=False):
    """One warm-up step and `steps` measured steps at length `n` in this process; the run's JSON object."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=max(n, 2048),
        attn_implementation="sdpa",
        torch_dtype=torch.float32,
    )
    model = LlamaForCausalLM(cfg).float()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = (torch.arange(n, dtype=torch.long) * 2654435761 >> 7) % cfg.vocab_size
    ids = ids.unsqueeze(0)
    times, cpu_times = [], []
    loss = None
    prof = None

    def forward_backward():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.item()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    for step in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        if profiled and step == steps:
            box = {}
            prof = profile_step(lambda: box.setdefault("loss", forward_backward()), optimizer)
            loss = box["loss"]
        else:
            loss = forward_backward()
            optimizer()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step > 0:
            times.append(dt)
            cpu_times.append(dc)
    times.sort()
    step_s = times[len(times) // 2]
    return {
        "bench": "pytorch",
        "n": n,
        "gradient_checkpointing": gradient_checkpointing,
        "steps": steps,
        "loss": loss,
        "step_s": step_s,
        "step_cpu_s": sorted(cpu_times)[len(cpu_times) // 2],
        "tokens_per_s": n / step_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg": loadavg(),
        "cpus": os.cpu_count(),
        "profile": prof,
    }


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().strip()


def run_fresh(n, gradient_checkpointing, steps):
    """`run_one` in a fresh Python process (so its peak RSS is this run's alone); its JSON object."""
    cmd = [sys.executable, os.path.abspath(__file__), "--n", str(n), "--steps", str(steps)]
    if gradient_checkpointing:
        cmd.append("--checkpoint")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.exit(
            f"pytorch_bench: the run at n = {n} (gradient checkpointing {gradient_checkpointing}) failed with "
            f"exit status {p.returncode} (a negative status is the signal, e.g. -9 when the kernel ran out of "
            f"memory); its stderr ends:\n{p.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def parse_bytes(s):
    """A byte count: a number with an optional suffix K/M/G (powers of ten) or Ki/Mi/Gi (powers of two)."""
    for suf, mult in [("Ki", 1024), ("Mi", 1024**2), ("Gi", 1024**3), ("K", 1e3), ("M", 1e6), ("G", 1e9)]:
        for cand in (suf, suf.lower()):
            if s.endswith(cand):
                return int(float(s[: -len(cand)]) * mult)
    return int(float(s))


def split_floor(points, rel_tol=1e-3):
    """(floor, growing): two or more points within rel_tol of the smallest peak are a flat floor
    (as autosp::capacity::split_floor); with one such point there is no floor."""
    low = min(p[1] for p in points)
    on = [p for p in points if p[1] <= low * (1 + rel_tol)]
    if len(on) < 2:
        return [], list(points)
    return on, [p for p in points if p[1] > low * (1 + rel_tol)]


def fit_peaks(points):
    """Least-squares peak = a + b*n through (n, peak) points (as autosp::capacity::fit_peaks):
    (a, b, rmse, max_rel_error, r2)."""
    if len({p[0] for p in points}) < 2:
        raise ValueError(
            f"a capacity fit needs peaks at two or more distinct lengths above the floor, got {len(points)} "
            "points: measure more (longer) lengths"
        )
    k = len(points)
    mx = sum(p[0] for p in points) / k
    my = sum(p[1] for p in points) / k
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    b = sxy / sxx
    a = my - b * mx
    resid = [p[1] - (a + b * p[0]) for p in points]
    ss_res = sum(r * r for r in resid)
    ss_tot = sum((p[1] - my) ** 2 for p in points)
    max_rel = max(abs(p[1] / (a + b * p[0]) - 1) for p in points)
    r2 = 1.0 if ss_tot == 0 else 1 - ss_res / ss_tot
    return a, b, math.sqrt(ss_res / k), max_rel, r2


def longest_fitting(a, b, budget, multiple):
    """The longest n, a multiple of `multiple` and at least `multiple`, with a + b*n <= budget
    (as autosp::capacity::longest_fitting)."""
    multiple = max(multiple, 1)
    if b <= 0:
        raise ValueError(f"the fitted peak does not grow with n (slope {b} bytes per token): measure longer lengths")
    if a + b * multiple > budget:
        raise ValueError(f"budget {budget} bytes is below the predicted peak {a + b * multiple:.0f} at n = {multiple}")
    n = int((budget - a) / b) // multiple * multiple
    while n > multiple and a + b * n > budget:
        n -= multiple
    while a + b * (n + multiple) <= budget:
        n += multiple
    return n


def capacity_line(args, gradient_checkpointing, points):
    """The `"bench":"capacity"` object of one gradient-checkpointing setting from its (n, peak RSS) points."""
    budget = parse_bytes(args.budget)
    floor, growing = split_floor(points)
    if floor and max(p[1] for p in floor) > budget:
        raise ValueError(f"--budget {budget} bytes is below the peak floor {max(p[1] for p in floor)} bytes: raise it")
    a, b, rmse, max_rel, r2 = fit_peaks(growing)
    predicted = longest_fitting(a, b, budget, args.capacity_multiple)
    confirmed = None
    if args.confirm:
        j = run_fresh(predicted, gradient_checkpointing, args.steps)
        print(json.dumps(j), flush=True)
        peak = j["peak_rss_bytes"]
        confirmed = {
            "n": predicted,
            "peak_rss_bytes": peak,
            "fits_budget": peak <= budget,
            "peak_vs_fit": peak / (a + b * predicted) - 1,
            "step_s": j["step_s"],
            "tokens_per_s": j["tokens_per_s"],
        }
    return {
        "bench": "capacity",
        "model": "pytorch:hf-llama-bench",
        "sp": 1,
        "launcher": "subprocess",
        "strategy": "pytorch",
        "checkpoint": "gradient-checkpointing" if gradient_checkpointing else "none",
        "gradient_checkpointing": gradient_checkpointing,
        "budget_bytes": budget,
        "peak_metric": "peak_rss_bytes: ru_maxrss of a fresh Python process that ran one warm-up and the "
        "measured steps at that n (includes the Python runtime and torch's libraries)",
        "points": [{"n": n, "peak_rss_bytes": p} for n, p in growing],
        "floor_points": [{"n": n, "peak_rss_bytes": p} for n, p in floor],
        "floor_note": "points within 0.1% of the smallest peak (two or more) are a flat floor, left out of the fit",
        "fit_a_bytes": a,
        "fit_b_bytes_per_token": b,
        "fit_rmse_bytes": rmse,
        "fit_max_rel_error": max_rel,
        "fit_r2": r2,
        "capacity_multiple": args.capacity_multiple,
        "predicted_max_n": predicted,
        "predicted_peak_at_max_n": a + b * predicted,
        "confirmed": confirmed,
        "confirmation": "one run at predicted_max_n" if args.confirm else "not confirmed (--confirm not given)",
        "cpus": os.cpu_count(),
        "loadavg": loadavg(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="8192", help="sequence lengths, comma separated")
    ap.add_argument("--steps", type=int, default=1, help="measured steps after one warm-up step")
    ap.add_argument("--checkpoint", action="store_true", help="HF gradient checkpointing on (= --gradient-checkpointing on)")
    ap.add_argument(
        "--gradient-checkpointing",
        default=None,
        help="off | on | off,on (each setting measured in turn); default off, or on with --checkpoint",
    )
    ap.add_argument("--capacity", action="store_true", help="fit peak RSS vs N per setting and predict the longest N under --budget")
    ap.add_argument("--budget", default="4Gi", help="byte budget of --capacity (K/M/G powers of ten, Ki/Mi/Gi powers of two)")
    ap.add_argument("--capacity-multiple", type=int, default=512, help="the predicted N is a multiple of this")
    ap.add_argument("--confirm", action="store_true", help="run once more at the predicted N (in a fresh process)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the last measured step with torch.profiler (one run only): self CPU s per op and kind")
    args = ap.parse_args()

    ns = [int(x) for x in args.n.split(",") if x]
    gc_arg = args.gradient_checkpointing or ("on" if args.checkpoint else "off")
    settings = []
    for s in gc_arg.split(","):
        if s not in ("off", "on"):
            sys.exit(f"--gradient-checkpointing {s!r}: use off, on or off,on")
        settings.append(s == "on")
    if args.steps < 1:
        sys.exit("--steps must be at least 1")
    parse_bytes(args.budget)

    if len(ns) == 1 and len(settings) == 1 and not args.capacity:
        # One run: in this process (its peak RSS is its own anyway).
        print(json.dumps(run_one(ns[0], settings[0], args.steps, args.profile)), flush=True)
        return
    if args.profile:
        sys.exit("--profile takes one --n and one --gradient-checkpointing setting")
    points = {gc: [] for gc in settings}
    for n in ns:
        for gc in settings:
            j = run_fresh(n, gc, args.steps)
            print(json.dumps(j), flush=True)
            points[gc].append((n, j["peak_rss_bytes"]))
    if args.capacity:
        for gc in settings:
            try:
                line = capacity_line(args, gc, points[gc])
            except ValueError as e:
                sys.exit(f"pytorch_bench --capacity (gradient checkpointing {gc}): {e}")
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
