"""Offline generation with rserve's Python API (vLLM's `LLM.generate` / `LLM.chat` shape).

    python examples/offline_generate.py [MODEL]

MODEL is a local model directory or a Hugging Face hub id (default: the tiny test model, whose
random weights produce nonsense text).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rserve import LLM, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models" / "qwen2"


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_MODEL)
    llm = LLM(model)

    # Several prompts are submitted together and batched by the engine; results come back in order.
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)
    for out in llm.generate(prompts, params):
        print(f"Prompt: {out.prompt!r}\nGenerated: {out.outputs[0].text!r}\n")

    # Chat: the model's chat template renders the conversation.
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about fast inference."},
    ]
    reply = llm.chat(messages, SamplingParams(temperature=0, max_tokens=48))[0]
    print(f"Chat reply: {reply.outputs[0].text!r} (finish reason: {reply.outputs[0].finish_reason})")
    llm.shutdown()


if __name__ == "__main__":
    main()
