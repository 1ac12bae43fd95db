#!/usr/bin/env python3
"""How far each quantized format moves a model's next-token distributions, for rserve's in-situ
quantization and, beside it, for llama.cpp's own quantization of the same weights run by
llama.cpp (and by rserve from the same GGUF file).

    python3 benchmarks/isq_quality.py --rserve target/release/rserve

The model is Qwen2-shaped with random f16 weights (hidden 256, so every projection row fits the
256-value K-quant blocks; 4 layers; the tiny test tokenizer), written twice with the same
values: as a Hugging Face checkpoint (what `--isq` quantizes while loading) and as an f16 GGUF
that llama.cpp's `llama_model_quantize` turns into its formats. The reference is rserve on the
checkpoint in f32. Token sequences are sampled from the reference (temperature 1, seeded), then
every engine and format scores the same sequences (teacher forcing). Per format it reports

- the mean absolute difference of the sampled tokens' log-probabilities from the reference's;
- KL(reference || quantized), estimated as the mean of log p_ref(x) - log p_q(x) over the
  sampled tokens x (a Monte Carlo estimate: the tokens are drawn from the reference), with its
  standard error.

rserve keeps the embeddings and the output head 16-bit unless `--isq-lm-head` (a row of its own);
llama.cpp's files quantize both (the head in q6_K for the K-quant recipes).

llama.cpp's rows are measured against llama.cpp's own f16 run (and that run against rserve's
reference is the first row), so its column shows what its quantization costs in its runtime.
llama.cpp is `llama-cpp-python` built from source, as `benchmarks/cpu_vs_llama_cpp.py` installs
it (benchmarks/.venv-llama-cpp); the script re-runs itself there. Writes one JSON line per row to
--out and prints a markdown table. Random weights magnify every rounding; trained models lose
less. A report, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_vs_llama_cpp import TOKENIZER, append_results, cpu_model, ensure_env, gguf_writer, log  # noqa: E402

SHAPE = dict(hidden=256, ff=768, layers=4, heads=4, kv=2, vocab=1024, theta=1e6, eps=1e-6)
# rserve's --isq formats and the llama.cpp ftypes beside them (llama.cpp's K-quant recipes mix
# types: Q4_K_M keeps some tensors in q6_K; its output head is quantized too)
ROWS = [
    ("q8_0", "q8_0", 7),
    ("q6k", "q6_k", 18),
    ("q4k", "q4_k_m", 15),
    ("q4_0", "q4_0", 2),
    # no llama.cpp counterpart
    ("fp8", None, None),
]


def weights(seed: int) -> dict[str, "object"]:
    """HF name -> f16 array (Qwen2: q/k/v biases, untied head)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    s = SHAPE
    h, hd = s["hidden"], s["hidden"] // s["heads"]

    def mat(rows: int, cols: int, std: float = 0.05):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def vec(n: int, std: float = 0.02):
        return (rng.standard_normal(n, dtype=np.float32) * std).astype(np.float16)

    w = {"model.embed_tokens.weight": mat(s["vocab"], h, 1.0), "model.norm.weight": np.ones(h, np.float16),
         "lm_head.weight": mat(s["vocab"], h, 0.2)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = np.ones(h, np.float16)
        w[f"{p}.post_attention_layernorm.weight"] = np.ones(h, np.float16)
        for name, rows in (("q_proj", s["heads"] * hd), ("k_proj", s["kv"] * hd), ("v_proj", s["kv"] * hd)):
            w[f"{p}.self_attn.{name}.weight"] = mat(rows, h)
            w[f"{p}.self_attn.{name}.bias"] = vec(rows)
        w[f"{p}.self_attn.o_proj.weight"] = mat(h, s["heads"] * hd)
        w[f"{p}.mlp.gate_proj.weight"] = mat(s["ff"], h)
        w[f"{p}.mlp.up_proj.weight"] = mat(s["ff"], h)
        w[f"{p}.mlp.down_proj.weight"] = mat(h, s["ff"])
    return w


def write_hf(d: Path, w: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    s = SHAPE
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": s["hidden"],
           "intermediate_size": s["ff"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv"], "vocab_size": s["vocab"], "rope_theta": s["theta"],
           "rms_norm_eps": s["eps"], "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "float16", "bos_token_id": 0, "eos_token_id": 1}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    header, blobs, at = {}, [], 0
    for name, a in w.items():
        b = a.tobytes()
        header[name] = {"dtype": "F16", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)
    shutil.copy(TOKENIZER, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|end_of_text|>"}))


def write_gguf(path: Path, w: dict) -> None:
    """The same weights as an f16 GGUF under llama.cpp's qwen2 names (no q/k permutation: qwen2
    rotates halves, as the checkpoint does)."""
    import numpy as np

    g = gguf_writer(path, {**SHAPE, "arch": "qwen2", "pre": "qwen2"})
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, a in w.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            stem, kind = rest.rsplit(".", 1)
            out = f"blk.{i}.{names[stem]}.{kind}"
        # norms and biases stay f32, as the converter writes them
        g.add_tensor(out, a.astype(np.float32) if a.ndim == 1 else a)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rserve:
    """`rserve serve` on a free port for one model and one set of flags."""

    def __init__(self, binary: str, model: Path, flags: list[str], threads: int):
        self.port = free_port()
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [binary, "serve", str(model), "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "1024", "--served-model-name", "m", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"rserve {' '.join(flags)} stopped:\n{self.proc.stderr.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        sys.exit("rserve did not start")

    def post(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "m", **body}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def sample(self, prompt: list[int], n: int, seed: int) -> list[int]:
        c = self.post({"prompt": prompt, "max_tokens": n, "temperature": 1.0, "seed": seed, "ignore_eos": True,
                       "logprobs": 0, "return_tokens_as_token_ids": True})["choices"][0]
        return [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]]

    def scores(self, seq: list[int]) -> list[float]:
        """log p(seq[i] | seq[:i]) for i >= 1."""
        plp = self.post({"prompt": seq, "max_tokens": 1, "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"]
        return [plp[i][str(seq[i])]["logprob"] for i in range(1, len(seq))]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def llama_scores(path: Path, seqs: list[list[int]], threads: int) -> list[list[float]]:
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, logits_all=True, verbose=False)
    out = []
    for seq in seqs:
        m.reset()
        m.eval(seq)
        logits = np.asarray(m.scores[: len(seq)], dtype=np.float64)
        lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        out.append([float(logits[i - 1, seq[i]] - lse[i - 1]) for i in range(1, len(seq))])
    del m
    return out


def compare(ref: list[list[float]], got: list[list[float]]) -> dict:
    diffs = [r - g for rs, gs in zip(ref, got) for r, g in zip(rs, gs)]
    n = len(diffs)
    kl = sum(diffs) / n
    # the estimate's standard error
    se = math.sqrt(sum((d - kl) ** 2 for d in diffs) / (n - 1) / n)
    return {"mean_abs_logprob_error": sum(abs(d) for d in diffs) / n, "kl": kl, "kl_se": se, "positions": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rserve", default=str(ROOT / "target" / "release" / "rserve"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rserve-isq-quality"))
    ap.add_argument("--sequences", type=int, default=24)
    ap.add_argument("--length", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-cpu-isq-quality.jsonl")
    args = ap.parse_args()
    ensure_env()
    import llama_cpp

    hf, f16 = args.work / "hf", args.work / "f16.gguf"
    if not (hf / "model.safetensors").exists() or not f16.exists():
        log(f"writing the model under {args.work}")
        w = weights(args.seed)
        write_hf(hf, w)
        write_gguf(f16, w)
    ggufs = {}
    for _, name, ftype in ROWS:
        if name is None:
            continue
        q = args.work / f"{name}.gguf"
        if not q.exists():
            log(f"quantizing {q.name} with llama.cpp")
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype = ftype
            if llama_cpp.llama_model_quantize(str(f16).encode(), str(q).encode(), ctypes.byref(p)) != 0:
                sys.exit(f"llama_model_quantize failed for {q}")
        ggufs[name] = q

    ref_srv = Rserve(args.rserve, hf, [], args.threads)
    prompts = [[17 + s, 256 + s, 33, 401 - s] for s in range(args.sequences)]
    seqs = [p + ref_srv.sample(p, args.length, args.seed + i) for i, p in enumerate(prompts)]
    ref = [ref_srv.scores(s) for s in seqs]
    ref_srv.stop()
    log(f"{len(seqs)} sequences of {len(seqs[0])} tokens sampled from the f32 reference")

    def rserve_on(model: Path, flags: list[str]) -> list[list[float]]:
        srv = Rserve(args.rserve, model, flags, args.threads)
        try:
            return [srv.scores(s) for s in seqs]
        finally:
            srv.stop()

    rows = []
    llama_f16 = llama_scores(f16, seqs, args.threads)
    rows.append({"format": "f16", "engine": "llama.cpp (f16 GGUF) vs rserve's f32 reference",
                 **compare(ref, llama_f16)})
    rows.append({"format": "f16", "engine": "rserve (f16 GGUF)", **compare(ref, rserve_on(f16, []))})
    for isq, name, _ in ROWS:
        rows.append({"format": isq, "engine": f"rserve --isq {isq}", **compare(ref, rserve_on(hf, ["--isq", isq]))})
        rows.append({"format": isq, "engine": f"rserve --isq {isq} --isq-lm-head",
                     **compare(ref, rserve_on(hf, ["--isq", isq, "--isq-lm-head"]))})
        if name is None:
            continue
        rows.append({"format": name, "engine": f"llama.cpp on its {name} GGUF (vs its f16)",
                     **compare(llama_f16, llama_scores(ggufs[name], seqs, args.threads))})
        rows.append({"format": name, "engine": f"rserve on llama.cpp's {name} GGUF",
                     **compare(ref, rserve_on(ggufs[name], []))})
    meta = {"date": str(datetime.date.today()), "cpu": cpu_model(), "threads": args.threads,
            "llama_cpp": getattr(llama_cpp, "__version__", "?"), "shape": SHAPE,
            "sequences": args.sequences, "length": args.length}
    append_results(args.out, meta, rows)
    print("| format | engine | mean abs log-prob error | KL (nats per token, +- s.e.) |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['engine']} | {r['mean_abs_logprob_error']:.4f} | "
              f"{r['kl']:.4f} +- {r['kl_se']:.4f} |")


if __name__ == "__main__":
    main()
