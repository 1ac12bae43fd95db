"""Talking to a running `rserve serve` with the official OpenAI client.

    rserve serve Qwen/Qwen2.5-0.5B-Instruct --port 8000     # in another terminal
    python examples/openai_client.py [BASE_URL]

BASE_URL defaults to $OPENAI_BASE_URL or http://127.0.0.1:8000/v1; the API key is
$OPENAI_API_KEY (any value unless the server was started with --api-key).
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    model = client.models.list().data[0].id
    print(f"model: {model}")

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello in three languages."}],
        max_tokens=32,
        temperature=0,
    )
    print(f"chat: {chat.choices[0].message.content!r}")
    if chat.usage is not None:
        print(f"usage: {chat.usage.prompt_tokens} prompt + {chat.usage.completion_tokens} completion tokens")

    print("streamed completion: ", end="", flush=True)
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=32,
        temperature=0.7,
        seed=0,
        stream=True,
        extra_body={"top_k": 50},  # vLLM extensions go in extra_body
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()
    client.close()


if __name__ == "__main__":
    main()
