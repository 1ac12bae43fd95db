"""Prefix caching over HTTP (on by default, vLLM v1's surface): a repeated prompt reports the
tokens it found in the cache as `usage.prompt_tokens_details.cached_tokens` (completions and chat,
streamed and not) with the same output, the `vllm:prefix_cache_*` counters count them,
`cache_salt` keeps requests apart (an empty one is a 400), and `POST /reset_prefix_cache` empties
the cache."""

from __future__ import annotations

import random
import re

import httpx
from openai import OpenAI

from support.http_checks import MODEL, assert_error, assert_still_serving, parse_sse

BLOCK = 16  # the server's default block size


def _prompt(seed: int, length: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 990) for _ in range(length)]


def _complete(http: httpx.Client, prompt: list[int], **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _counter(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_a_repeated_prompt_is_served_from_the_cache(http: httpx.Client) -> None:
    prompt = _prompt(1)
    hits0 = _counter(http, "vllm:prefix_cache_hits_total")
    queries0 = _counter(http, "vllm:prefix_cache_queries_total")
    first = _complete(http, prompt)
    assert _cached(first) == 0
    second = _complete(http, prompt)
    # every full block but the one holding the last prompt token (its logits are computed)
    want = (len(prompt) - 1) // BLOCK * BLOCK
    assert _cached(second) == want
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert _counter(http, "vllm:prefix_cache_hits_total") - hits0 >= want
    assert _counter(http, "vllm:prefix_cache_queries_total") - queries0 >= 2 * len(prompt)


def test_streamed_usage_counts_cached_tokens(http: httpx.Client) -> None:
    prompt = _prompt(2)
    _complete(http, prompt)
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.read()
        events = parse_sse(r)
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] == 64


def test_chat_through_the_openai_client(client: OpenAI) -> None:
    text = " ".join(f"word{i}" for i in range(30))  # ~180 tokens: the server takes 256
    msgs = [{"role": "user", "content": f"Summarize: {text}"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    # (the chat template's opening may already be cached by other chat requests)
    first, second = (r.usage.prompt_tokens_details.cached_tokens for r in (a, b))
    assert second >= first + BLOCK, (first, second)
    assert a.choices[0].message.content == b.choices[0].message.content
    # another salt shares nothing; the same salt shares again
    salted = {**kw, "extra_body": {"cache_salt": "tenant-1"}}
    assert client.chat.completions.create(**salted).usage.prompt_tokens_details.cached_tokens == 0
    assert client.chat.completions.create(**salted).usage.prompt_tokens_details.cached_tokens > 0


def test_salts_are_checked_and_keep_requests_apart(http: httpx.Client) -> None:
    prompt = _prompt(3)
    assert _cached(_complete(http, prompt, cache_salt="a")) == 0
    assert _cached(_complete(http, prompt, cache_salt="b")) == 0
    assert _cached(_complete(http, prompt)) == 0
    assert _cached(_complete(http, prompt, cache_salt="a")) == 64
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""},
    )
    assert_error(r, 400, "cache_salt", param="cache_salt")
    assert_still_serving(http)


def test_responses_take_a_salt(http: httpx.Client) -> None:
    text = " ".join(f"respond{i}" for i in range(12))

    def cached(**kw) -> int:
        r = http.post("/v1/responses", json={"model": MODEL, "input": text, "max_output_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    cached(cache_salt="r-a")
    assert cached(cache_salt="r-b") == 0
    assert cached(cache_salt="r-a") > 0
    r = http.post("/v1/responses", json={"model": MODEL, "input": text, "cache_salt": ""})
    assert_error(r, 400, "cache_salt", param="cache_salt")
    assert_still_serving(http)


def test_a_reset_empties_the_cache(http: httpx.Client) -> None:
    prompt = _prompt(4)
    _complete(http, prompt)
    assert _cached(_complete(http, prompt)) == 64
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200, r.text
    assert r.json()["cached_blocks"] >= 4
    assert _cached(_complete(http, prompt)) == 0
