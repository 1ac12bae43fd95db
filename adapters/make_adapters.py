#!/usr/bin/env python3
"""Make PEFT LoRA adapters for a base model, and (for the test fixtures) what transformers + peft
compute with them.

Fixture mode (no arguments): tiny seeded adapters on the tiny test models, written with peft's
own `save_pretrained` (adapter_config.json + adapter_model.safetensors) into
adapters/fixtures/NAME/, and goldens in tests/fixtures/goldens/lora-NAME.json in the format of
tests/fixtures/make_models.py (greedy tokens, their log-probs, the top 5 and the prompt log-probs
for the same prompts, float32, CPU). peft initializes B to zero, which would make every adapter a
no-op; here A and B are both drawn from a seeded normal so that each adapter moves the logits.

Base mode (`--base DIR --out DIR [--rank 16] [--count 8]`): adapters of the given rank on all
seven projections of the base at DIR (shapes read from its config.json; no weights loaded), for
the serving benchmark.

Needs: torch, transformers 5, peft, safetensors, tokenizers.

Usage:
  python adapters/make_adapters.py
  python adapters/make_adapters.py --base /path/to/Llama-3.1-8B --out /tmp/adapters --count 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))
sys.dont_write_bytecode = True

import torch  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name: (base fixture, rank, alpha, targets, rslora, seed)
FIXTURE_ADAPTERS = {
    "llama3-r8-qv": ("llama3", 8, 16, ["q_proj", "v_proj"], False, 1),
    "llama3-r4-all": ("llama3", 4, 8, ALL, False, 2),
    "llama3-r16-rslora-mlp": ("llama3", 16, 8, ["gate_proj", "up_proj", "down_proj"], True, 3),
    "qwen2-r8-all": ("qwen2", 8, 32, ALL, False, 4),
}


def randomize(model, seed: int, std: float = 0.3) -> None:
    """Every LoRA A and B drawn from a seeded normal (std / sqrt(fan-in) for A, std for B)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_fixtures() -> None:
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    import make_models

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for name, (base, rank, alpha, targets, rslora, seed) in FIXTURE_ADAPTERS.items():
        base_dir = FIXTURES / "models" / base
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                         lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, cfg)
        randomize(peft_model, seed)
        peft_model.eval()
        out = ROOT / "adapters" / "fixtures" / name
        peft_model.save_pretrained(out)
        (out / "README.md").unlink(missing_ok=True)  # peft's model card names this machine's paths
        # the base path as a relative one, so the fixture does not name this machine
        conf_path = out / "adapter_config.json"
        conf = json.loads(conf_path.read_text())
        conf["base_model_name_or_path"] = f"tests/fixtures/models/{base}"
        conf_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
        cases = [make_models.golden_case(peft_model, p) for p in make_models.prompts(tok)]
        golden = {"model": f"adapters/fixtures/{name}", "dtype": "float32", "cases": cases}
        path = FIXTURES / "goldens" / f"lora-{name}.json"
        path.write_text(make_models.format_golden(golden))
        print(f"{name}: rank {rank}, alpha {alpha}, {len(targets)} targets, rslora {rslora} -> {out}, {path}")


def make_for_base(base: Path, out: Path, rank: int, count: int) -> None:
    """Adapters for the serving benchmark: safetensors written directly from the config's shapes."""
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd), "v_proj": (hidden, kv * hd),
              "o_proj": (heads * hd, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    for a in range(count):
        g = torch.Generator().manual_seed(1000 + a)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for proj, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                pre = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(torch.bfloat16)
                tensors[f"{pre}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
        d = out / f"adapter-{a:03d}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                "target_modules": sorted(shapes), "lora_dropout": 0.0, "bias": "none",
                "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(base)}
        (d / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    print(f"{count} rank-{rank} adapters for {base} in {out}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--count", type=int, default=8)
    a = p.parse_args()
    if a.base is None:
        make_fixtures()
    else:
        if a.out is None:
            raise SystemExit("--out DIR is needed with --base")
        make_for_base(a.base, a.out, a.rank, a.count)


if __name__ == "__main__":
    main()
