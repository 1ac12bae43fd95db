#!/usr/bin/env python3
"""rserve against llama.cpp on the CPU, on the same GGUF files: prefill of 512 tokens and batch-1
decode for q4_0, q8_0 and q4_K_M, with a Qwen2.5-0.5B-shaped and a Llama-3.2-1B-shaped model of
random weights; and decode of 8 sequences at once (llama.cpp through `llama_decode` batches of one
token per sequence, as its `batched` example). Both engines get the same number of threads and
run one after the other.

    python3 benchmarks/cpu_vs_llama_cpp.py --rserve target/release/rserve --threads 2

llama.cpp is `llama-cpp-python` built from source by pip (about 13 minutes on 2 cores); the script
installs it, with numpy and gguf, into benchmarks/.venv-llama-cpp on first use and re-runs itself
there. Each model is written once as an f16 GGUF (numpy, std 0.02 weights, the tiny test
tokenizer's vocabulary padded to the model's size with unused tokens) and quantized by llama.cpp's
own `llama_model_quantize`; the files are kept under --work.

Prints a markdown table with the ratios and writes one JSON line per (shape, format) to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "benchmarks" / ".venv-llama-cpp"
TOKENIZER = ROOT / "crates" / "core" / "assets" / "tokenizer.json"

SHAPES = {
    "qwen2.5-0.5b": dict(arch="qwen2", pre="qwen2", hidden=896, ff=4864, layers=24, heads=14,
                         kv=2, vocab=151936, theta=1e6, eps=1e-6, bias=True),
    "llama-3.2-1b": dict(arch="llama", pre="llama-bpe", hidden=2048, ff=8192, layers=16,
                         heads=32, kv=8, vocab=128256, theta=5e5, eps=1e-5, bias=False),
}
# llama.cpp's llama_ftype values
FORMATS = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_env() -> None:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        py = VENV / "bin" / "python"
        # (a venv's python links to the base interpreter: compare the prefixes, not the files)
        if Path(sys.prefix).resolve() == VENV.resolve():
            raise
        if not py.exists():
            log(f"creating {VENV} and building llama-cpp-python from source")
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "llama-cpp-python", "numpy",
                            "gguf"], check=True)
        os.execv(str(py), [str(py), *sys.argv])


def gguf_writer(path: Path, s: dict):
    """An f16 GGUF writer for the shape `s` (hyperparameters, `arch`, `pre`) with the test
    tokenizer's vocabulary, padded with unused tokens to `s["vocab"]`; the tensors are the
    caller's."""
    import gguf

    tok = json.loads(TOKENIZER.read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    special = {a["id"] for a in tok["added_tokens"]}
    types = [3 if i in special else 1 for i in range(len(tokens))]
    tokens += [f"<|unused_{i}|>" for i in range(len(tokens), s["vocab"])]
    types += [5] * (s["vocab"] - len(types))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), s["arch"])
    w.add_block_count(s["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(s["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    return w


def append_results(out: Path, meta: dict, rows: list[dict]) -> None:
    """Appends each row, with `meta`, as a JSON line to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")


def write_f16(path: Path, s: dict, seed: int) -> None:
    import numpy as np

    w = gguf_writer(path, s)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    h, hd = s["hidden"], s["hidden"] // s["heads"]
    w.add_tensor("token_embd.weight", mat(s["vocab"], h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        for name, rows in (("attn_q", s["heads"] * hd), ("attn_k", s["kv"] * hd),
                           ("attn_v", s["kv"] * hd)):
            w.add_tensor(f"{b}.{name}.weight", mat(rows, h))
            if s["bias"]:
                w.add_tensor(f"{b}.{name}.bias", np.zeros(rows, dtype=np.float32))
        w.add_tensor(f"{b}.attn_output.weight", mat(h, s["heads"] * hd))
        w.add_tensor(f"{b}.ffn_gate.weight", mat(s["ff"], h))
        w.add_tensor(f"{b}.ffn_up.weight", mat(s["ff"], h))
        w.add_tensor(f"{b}.ffn_down.weight", mat(h, s["ff"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_files(work: Path, shape: str, seed: int) -> dict[str, Path]:
    import llama_cpp

    work.mkdir(parents=True, exist_ok=True)
    f16 = work / f"{shape}-f16.gguf"
    if not f16.exists():
        log(f"writing {f16}")
        write_f16(f16.with_suffix(".tmp"), SHAPES[shape], seed)
        f16.with_suffix(".tmp").rename(f16)
    out = {}
    for fmt, ftype in FORMATS.items():
        q = work / f"{shape}-{fmt}.gguf"
        if not q.exists():
            log(f"quantizing {q.name} with llama.cpp")
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype = ftype
            rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(q).encode(), ctypes.byref(p))
            if rc != 0:
                sys.exit(f"llama_model_quantize failed for {q} ({rc})")
        out[fmt] = q
    return out


def bench_llama_cpp(path: Path, args, vocab: int) -> dict:
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=args.threads,
                        n_threads_batch=args.threads, verbose=False)
    rng = np.random.default_rng(1)
    ids = [int(i) for i in rng.integers(20, min(vocab, 1000), 1024)]
    pre, dec = [], []
    for _ in range(args.reps):
        m.reset()
        t = time.perf_counter()
        m.eval(ids[: args.prefill_len])
        pre.append(args.prefill_len / (time.perf_counter() - t))
        m.reset()
        m.eval(ids[: args.prompt_len])
        t = time.perf_counter()
        for i in range(args.output_len):
            m.eval([ids[args.prompt_len + i]])
        dec.append(args.output_len / (time.perf_counter() - t))
    del m
    return {"prefill_tok_s": statistics.median(pre), "decode_b1_tok_s": statistics.median(dec)}


def bench_llama_cpp_batch(path: Path, args, vocab: int, batch: int = 8) -> float:
    """llama.cpp's decode of `batch` sequences at once (each after its own prompt of
    --prompt-len tokens): one `llama_decode` of `batch` tokens, one per sequence, per step, as
    llama.cpp's `batched` example runs them; output tokens per second over all sequences."""
    import llama_cpp
    import numpy as np

    # one llama_decode holds a whole prompt (the batch is made for 512 tokens), and a sequence's
    # 1,024 ids cover its prompt and output
    if args.prompt_len > 512 or args.prompt_len + args.output_len > 1024:
        sys.exit("batch 8 against llama.cpp: --prompt-len must be <= 512 and --prompt-len + --output-len <= 1024")
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 1024 * batch
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = batch
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    b = llama_cpp.llama_batch_init(512, 0, 1)
    rng = np.random.default_rng(2)
    ids = [[int(i) for i in rng.integers(20, min(vocab, 1000), 1024)] for _ in range(batch)]

    def decode(items: list[tuple[int, int, int]]) -> None:
        b.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, 1
            b.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, b) != 0:
            sys.exit(f"llama_decode failed on {path}")

    rates = []
    for _ in range(args.reps):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        for seq in range(batch):
            decode([(ids[seq][p], p, seq) for p in range(args.prompt_len)])
        t = time.perf_counter()
        for i in range(args.output_len):
            p = args.prompt_len + i
            decode([(ids[seq][p], p, seq) for seq in range(batch)])
        rates.append(batch * args.output_len / (time.perf_counter() - t))
    llama_cpp.llama_batch_free(b)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return statistics.median(rates)


def bench_rserve(path: Path, args) -> dict:
    cmd = [args.rserve, "bench", str(path), "--prefill-len", str(args.prefill_len),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--batch", "1,8", "--reps", str(args.reps), "--max-model-len", "1024", "--json"]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"rserve bench failed:\n{done.stderr}")
    v = json.loads(done.stdout.strip().splitlines()[-1])
    dec = {d["batch"]: d["tok_s"] for d in v["decode"]}
    return {"prefill_tok_s": v["prefill_tok_s"], "decode_b1_tok_s": dec[1],
            "decode_b8_tok_s": dec[8], "load_s": v["load_s"]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rserve", default=str(ROOT / "target" / "release" / "rserve"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/rserve-bench/gguf")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    ensure_env()
    import llama_cpp

    rows = []
    for shape in args.shapes.split(","):
        files = ensure_files(Path(args.work), shape, seed=0)
        for fmt in args.formats.split(","):
            path = files[fmt]
            log(f"{shape} {fmt}: llama.cpp")
            ll = bench_llama_cpp(path, args, SHAPES[shape]["vocab"])
            ll["decode_b8_tok_s"] = bench_llama_cpp_batch(path, args, SHAPES[shape]["vocab"])
            log(f"{shape} {fmt}: rserve")
            rs = bench_rserve(path, args)
            row = {
                "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
                "threads": args.threads, "shape": shape, "format": fmt,
                "file_mib": round(path.stat().st_size / 2**20, 1),
                "llama_cpp_version": llama_cpp.__version__, "llama_cpp": ll, "rserve": rs,
                "decode_ratio": rs["decode_b1_tok_s"] / ll["decode_b1_tok_s"],
                "prefill_ratio": rs["prefill_tok_s"] / ll["prefill_tok_s"],
                "decode_b8_ratio": rs["decode_b8_tok_s"] / ll["decode_b8_tok_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\nCPU: {cpu_model()}, {args.threads} threads; prefill {args.prefill_len} tokens, "
          f"decode {args.output_len} tokens after {args.prompt_len}\n")
    print("| shape | format | llama.cpp prefill | rserve prefill | ratio | llama.cpp decode b1 "
          "| rserve decode b1 | ratio | llama.cpp decode b8 | rserve decode b8 | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ll, rs = r["llama_cpp"], r["rserve"]
        print(f"| {r['shape']} | {r['format']} | {ll['prefill_tok_s']:.1f} | "
              f"{rs['prefill_tok_s']:.1f} | {r['prefill_ratio']:.2f}x | "
              f"{ll['decode_b1_tok_s']:.1f} | {rs['decode_b1_tok_s']:.1f} | "
              f"{r['decode_ratio']:.2f}x | {ll['decode_b8_tok_s']:.1f} | {rs['decode_b8_tok_s']:.1f} | "
              f"{r['decode_b8_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
