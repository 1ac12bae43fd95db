#!/usr/bin/env python3
"""The CUDA wheel on the GPU: `rserve.LLM(..., device="cuda")` reproduces the float32 goldens of every
tiny checkpoint (greedy tokens, logprobs within 1e-4), and streams. Run by scripts/gpu/check.sh
(`wheel` part) after installing target/cuda/wheels/*.whl."""

import json
import sys
from pathlib import Path

import rserve

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"

failures = 0
for name in ["llama3", "llama2", "mistral", "qwen2", "qwen3"]:
    golden = json.loads((FIX / "goldens" / f"{name}.json").read_text())
    llm = rserve.LLM(str(FIX / "models" / name), device="cuda", dtype="float32", gpu_memory_utilization=0.2)
    cases = golden["cases"]
    prompts = [{"prompt_token_ids": c["prompt"]} for c in cases]
    params = [rserve.SamplingParams(max_tokens=len(c["tokens"]), temperature=0, ignore_eos=True, logprobs=1) for c in cases]
    outs = llm.generate(prompts, params)
    for c, o in zip(cases, outs):
        comp = o.outputs[0]
        ok = list(comp.token_ids) == c["tokens"]
        err = max(abs(lp - w) for lp, w in zip([x.logprob for x in comp.logprobs], c["logprobs"]))
        ok = ok and err < 1e-4
        failures += not ok
        print(f"{name}: {len(c['prompt'])}-token prompt, tokens equal: {list(comp.token_ids) == c['tokens']}, max logprob err {err:.2e}")
    text = "".join(o.outputs[0].delta for o in llm.stream("Hello", rserve.SamplingParams(max_tokens=8, temperature=0)))
    print(f"{name}: streamed {text!r}")
    del llm
print("wheel check:", "ok" if failures == 0 else f"{failures} failures")
sys.exit(1 if failures else 0)
