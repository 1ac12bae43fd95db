#!/usr/bin/env python3
"""Tensor parallelism on a multi-GPU machine, measured through the server (uses check.py's helpers):

  8b    the Llama-3.1-8B shape (random bf16 weights made here) at each --sizes entry that fits the
        GPUs: teacher-forced log-probs of 1000 tokens against TP=1, batch-1 decode (4 prompts of
        512 in / 256 out) and 256 concurrent (256 prompts of 512 / 256)
  70b   the Llama-3.1-70B shape (hidden 8192, 80 layers, 64 heads, 8 KV heads; random bf16 weights
        written layer by layer to --scratch70, /dev/shm by default) at the largest size: load time,
        batch-1 decode against the bandwidth floor, 64 concurrent

  python3 scripts/gpu/check_tp.py --binary target/gpu-bundle/rserve --out $OUT --parts 8b,70b
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check  # noqa: E402

H200_BW = 4.8e12  # bytes/s, HBM3e


def gpus() -> int:
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len([ln for ln in r.stdout.splitlines() if ln.startswith("GPU ")])


# Each TP > 1 run's collectives and scheduling: the default (peer all-reduce fused with the residual
# add and norm, async scheduling), and with --ab each of those taken away in turn.
VARIANTS = {
    "default": ({}, []),
    "no-async": ({}, ["--no-async-scheduling"]),
    "unfused": ({"RSERVE_TP_FUSED_NORM": "0"}, ["--no-async-scheduling"]),
    "nccl": ({"RSERVE_TP_PEER_ALLREDUCE": "0"}, ["--no-async-scheduling"]),
}


def tp_server(a, path: Path, out: Path, tp: int, variant: str) -> check.Server:
    """`rserve serve` of `path` over `tp` GPUs, in one of the VARIANTS."""
    env, args = VARIANTS[variant]
    return check.Server(a.binary, str(path), a.port, out, "--max-model-len", "4096",
                        "--tensor-parallel-size", str(tp), *args, env=env,
                        tag=f"-tp{tp}" + ("" if variant == "default" else f"-{variant}"))


def runs_of(a, sizes: list[int], ab: tuple[str, ...] = tuple(VARIANTS)) -> list[tuple[int, str]]:
    asked = [] if a.ab is None else list(VARIANTS) if a.ab == "all" else a.ab.split(",")
    more = [v for v in ab if v != "default" and v in asked]
    return [(tp, "default") for tp in sizes] + [(tp, v) for tp in sizes if tp > 1 for v in more]


def part_8b(a, out: Path, sizes: list[int]) -> None:
    import torch

    _, path = check.fresh_checkpoint("llama-3.1-8b", Path(a.scratch))
    g = torch.Generator().manual_seed(1)
    ids = [1] + torch.randint(20, 30000, (1000,), generator=g).tolist()
    base = None
    for tp, variant in runs_of(a, sizes):
        srv = tp_server(a, path, out, tp, variant)
        try:
            rec = {"part": "tp-8b", "tp": tp, "ready_s": round(srv.ready_s, 2)}
            if tp > 1:
                rec["variant"] = variant
            lp = check.teacher_forced_rserve(srv, ids)
            if base is None:
                # TP=1 is the reference; every position's arg-max is compared
                base = (*lp, [1.0] * len(lp[0]))
            else:
                rec["vs_tp1"] = {k: v for k, v in check.compare(f"tp{tp}", base, lp).items()
                                 if k in ("mean_abs_err", "max_abs_err", "argmax_checked", "argmax_agree")}
            b1 = check.bench(a, srv, out, 1, 4, 512, 256)
            rec["b1_decode_tok_s"] = round(1000.0 / b1["tpot_ms"]["median"], 1)
            c256 = check.bench(a, srv, out, 256, 256, 512, 256)
            rec["c256_output_tok_s"] = round(c256["output_throughput"], 1)
            rec["c256_ttft_ms_median"] = c256["ttft_ms"]["median"]
            check.emit(out, rec)
        finally:
            srv.stop()
    shutil.rmtree(path, ignore_errors=True)


LLAMA_70B = {"hidden": 8192, "inter": 28672, "layers": 80, "heads": 64, "kv": 8, "vocab": 128256}


def write_70b(root: Path, shape: dict | None = None, name: str = "llama-3.1-70b") -> Path:
    """Random bf16 weights of the Llama-3.1-70B shape (or `shape`), made on the GPU and saved a
    few layers per file by several threads (never the whole model in memory at once)."""
    import torch
    from safetensors.torch import save_file

    sh = shape or LLAMA_70B
    path = root / name
    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    h, inter, layers, heads, kv, vocab = (sh[k] for k in ("hidden", "inter", "layers", "heads", "kv", "vocab"))
    need = 2 * (layers * (2 * h * h + 2 * h * h * kv // heads + 3 * h * inter) + 2 * vocab * h)
    free = shutil.disk_usage(path).free
    if free < need * 1.02:
        raise SystemExit(f"{name}: {path} has {free / 1e9:.0f} GB free; the weights need {need / 1e9:.0f} GB")
    d = h // heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    check.word_tokenizer(vocab, path)
    per_file = 4

    def write(f: int) -> dict[str, str]:
        # one generator per file (seeded by its index): files are written by several threads
        gen = torch.Generator(device="cuda").manual_seed(f)

        def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * std).cpu()

        first = f * per_file
        tensors = {}
        for i in range(first, min(first + per_file, layers)):
            p = f"model.layers.{i}."
            tensors[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
            tensors[p + "self_attn.k_proj.weight"] = rnd(kv * d, h)
            tensors[p + "self_attn.v_proj.weight"] = rnd(kv * d, h)
            tensors[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
            tensors[p + "mlp.gate_proj.weight"] = rnd(inter, h)
            tensors[p + "mlp.up_proj.weight"] = rnd(inter, h)
            tensors[p + "mlp.down_proj.weight"] = rnd(h, inter, std=0.01)
            tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if first + per_file >= layers:
            tensors["model.embed_tokens.weight"] = rnd(vocab, h)
            tensors["lm_head.weight"] = rnd(vocab, h)
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        name = f"model-{f:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        return {k: name for k in tensors}

    index: dict[str, str] = {}
    t0 = time.time()
    with ThreadPoolExecutor(4) as pool:
        for names in pool.map(write, range(-(-layers // per_file))):
            index.update(names)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    check.log(f"{name}: {size / 1e9:.1f} GB written in {time.time() - t0:.0f} s")
    return path


def part_70b(a, out: Path, tp: int) -> None:
    path = write_70b(Path(a.scratch70))
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    # the 70B shape loads in ~20 s: the default and NCCL's all-reduce only
    for _, variant in runs_of(a, [tp], ("default", "nccl")):
        srv = tp_server(a, path, out, tp, variant)
        try:
            b1 = check.bench(a, srv, out, 1, 4, 512, 128)
            c64 = check.bench(a, srv, out, 64, 64, 512, 128)
            floor = H200_BW * tp / size
            tok_s = 1000.0 / b1["tpot_ms"]["median"]
            check.emit(out, {
                "part": "tp-70b", "tp": tp, "variant": variant, "weights_gb": round(size / 1e9, 1),
                "load_s": round(srv.ready_s, 1), "b1_decode_tok_s": round(tok_s, 1),
                "floor_tok_s": round(floor, 1), "of_floor": round(tok_s / floor, 3),
                "c64_output_tok_s": round(c64["output_throughput"], 1),
            })
        finally:
            srv.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="8b,70b")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--scratch", default="/tmp/rserve-big")
    p.add_argument("--scratch70", default="/dev/shm/rserve-70b")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--ab", nargs="?", const="all", default=None,
                   help="also run each TP > 1 in the VARIANTS named (comma-separated; all when none "
                        "is named): without async scheduling, then also without the fused norm, "
                        "then with NCCL's all-reduce")
    a = p.parse_args()
    unknown = [] if a.ab in (None, "all") else [v for v in a.ab.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--ab: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    n = gpus()
    sizes = [s for s in map(int, a.sizes.split(",")) if s <= n]
    parts = a.parts.split(",")
    if "8b" in parts:
        part_8b(a, a.out, sizes)
    if "70b" in parts and n >= 2:
        part_70b(a, a.out, max(s for s in sizes if s >= 2))


if __name__ == "__main__":
    main()
