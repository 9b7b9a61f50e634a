"""The PyTorch reference for bench_memory: HF transformers' LlamaForCausalLM with the `bench` preset
(vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads, 4 kv heads, untied, rope_theta 10000, f32),
SDPA attention, AdamW, on the CPU; one JSON line per run with the step time and the process's peak RSS.

    /work/venv-golden/bin/python scripts/pytorch_bench.py --n 8192 [--checkpoint] [--steps 1]

Peak RSS (ru_maxrss) covers the whole process since it started (weights, AdamW moments, activations and the
allocator's cached blocks), like the tracking allocator's process peak in bench_memory but also counting
the Python runtime and torch's libraries.
"""

import argparse
import json
import os
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1, help="measured steps after one warm-up step")
    ap.add_argument("--checkpoint", action="store_true", help="HF gradient checkpointing on")
    args = ap.parse_args()

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
        max_position_embeddings=max(args.n, 2048),
        attn_implementation="sdpa",
        torch_dtype=torch.float32,
    )
    model = LlamaForCausalLM(cfg).float()
    if args.checkpoint:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = (torch.arange(args.n, dtype=torch.long) * 2654435761 >> 7) % cfg.vocab_size
    ids = ids.unsqueeze(0)
    times, cpu_times = [], []
    loss = None
    for step in range(args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        loss = out.loss.item()
        del out
        if step > 0:
            times.append(dt)
            cpu_times.append(dc)
    times.sort()
    step_s = times[len(times) // 2]
    print(
        json.dumps(
            {
                "bench": "pytorch",
                "n": args.n,
                "gradient_checkpointing": args.checkpoint,
                "steps": args.steps,
                "loss": loss,
                "step_s": step_s,
                "step_cpu_s": sorted(cpu_times)[len(cpu_times) // 2],
                "tokens_per_s": args.n / step_s,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "loadavg": open("/proc/loadavg").read().strip(),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
