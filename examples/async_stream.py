"""Streaming with asyncio: several requests stream at once from one engine, printing text as it
arrives. Leaving an `async for` early (or cancelling its task) aborts that request.

    python examples/async_stream.py [MODEL]

MODEL is a local model directory or a Hugging Face hub id (default: the tiny test model).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rserve import LLM, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models" / "qwen2"


async def stream_one(llm: LLM, name: str, prompt: str, params: SamplingParams) -> str:
    """Prints each new piece of text as `[name] delta`; returns the final text."""
    text = ""
    async for out in llm.astream(prompt, params):
        delta = out.outputs[0].delta
        if delta:
            print(f"[{name}] {delta!r}", flush=True)
        text = out.outputs[0].text
    return text


async def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_MODEL)
    llm = LLM(model)
    params = SamplingParams(temperature=0.7, max_tokens=24, seed=1)
    texts = await asyncio.gather(
        stream_one(llm, "a", "Tell me a joke:", params),
        stream_one(llm, "b", "List three colors:", params),
    )
    for name, text in zip("ab", texts):
        print(f"final [{name}]: {text!r}")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
