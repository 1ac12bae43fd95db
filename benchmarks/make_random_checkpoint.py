#!/usr/bin/env python3
"""Writes a checkpoint with a real model's shape and random weights (normal, std 0.02), in bf16,
for CPU benchmarks without torch: config.json, model.safetensors (written directly), and the tiny
test model's tokenizer (its 1,000 ids are a subset of the model's vocabulary).

    python benchmarks/make_random_checkpoint.py qwen2.5-0.5b /tmp/rserve-bench/qwen2.5-0.5b-shape

Needs numpy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FROM = ROOT / "tests" / "fixtures" / "models" / "qwen2"

SHAPES = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "attention_bias": True,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "attention_bias": False,
    },
}


def tensors(c: dict):
    """(name, shape) of every weight, in checkpoint order."""
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{p}.self_attn.{name}.weight", (rows, h)
            if c["attention_bias"]:
                yield f"{p}.self_attn.{name}.bias", (rows,)
        yield f"{p}.self_attn.o_proj.weight", (h, q)
        yield f"{p}.mlp.gate_proj.weight", (inter, h)
        yield f"{p}.mlp.up_proj.weight", (inter, h)
        yield f"{p}.mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)


def bf16_bytes(x: np.ndarray) -> bytes:
    """f32 -> bf16 (round to nearest even) as little-endian bytes."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16).tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = dict(SHAPES[a.shape])
    bias = c.pop("attention_bias")
    a.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    c.update({"torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 3})
    if c["model_type"] == "llama":
        c["attention_bias"] = bias
    (a.out / "config.json").write_text(json.dumps(c, indent=1))
    c["attention_bias"] = bias
    header, offset, order = {}, 0, []
    for name, shape in tensors(c):
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
        order.append((name, shape))
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(a.out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, shape in order:
            if name.endswith("norm.weight"):
                x = np.ones(shape, np.float32)
            else:
                x = rng.standard_normal(shape, np.float32) * 0.02
            f.write(bf16_bytes(x))
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / fname, a.out / fname)
    print(f"wrote {a.out} ({offset / 2**20:.0f} MiB of bf16 weights)")


if __name__ == "__main__":
    main()
