"""Black-box tests of rserve's OpenAI-compatible HTTP server (vLLM's dialect).

The server runs the tiny random-weight qwen2 fixture (vocabulary of 1000 tokens, EOS id 3, ChatML
template) as `tiny-qwen` with a context of 256 tokens. Its text is nonsense, but greedy decoding
(temperature 0) is deterministic, which is what most assertions below rely on.
"""

from __future__ import annotations

import asyncio
import re
import time
import warnings

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from support.http_checks import assert_error, assert_still_serving, parse_sse, post_raw_body

MODEL = "tiny-qwen"
MAX_MODEL_LEN = 256
VOCAB_SIZE = 1000
EOS_ID = 3
BOS_TEXT = "<|begin_of_text|>"
SPECIAL_TOKEN_ID = 5  # "<|end_header_id|>", a special token that is not EOS
SPECIAL_TOKEN_TEXT = "<|end_header_id|>"
CONTEXT_ERROR = "maximum context length is 256 tokens"

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]
GREEDY = {"temperature": 0}
IGNORE_EOS = {"ignore_eos": True}
TOKEN_ID_RE = re.compile(r"^token_id:(\d+)$")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def check_usage(usage, prompt_tokens=None, completion_tokens=None) -> dict:
    """`usage` has the three counts, consistent with each other (and with the expected values)."""
    assert usage is not None, "usage is missing"
    u = usage if isinstance(usage, dict) else usage.model_dump()
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(u.get(key), int), f"usage.{key} is not an int: {u}"
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    if prompt_tokens is not None:
        assert u["prompt_tokens"] == prompt_tokens, u
    if completion_tokens is not None:
        assert u["completion_tokens"] == completion_tokens, u
    return u


def tokenize(http: httpx.Client, **body) -> dict:
    r = http.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def token_count(http: httpx.Client, **body) -> int:
    return tokenize(http, **body)["count"]


def detokenize(http: httpx.Client, tokens: list[int]) -> str:
    r = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def complete(client: OpenAI, prompt=PROMPT, max_tokens=8, extra=None, **kw):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra, **{**GREEDY, **kw}
    )


def chat(client: OpenAI, messages=None, max_tokens=8, extra=None, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages or MESSAGES,
        max_tokens=max_tokens,
        extra_body=extra,
        **{**GREEDY, **kw},
    )


def stream_raw(http: httpx.Client, path: str, body: dict) -> list[dict]:
    return parse_sse(http.post(path, json={"model": MODEL, "stream": True, **body}))


_SAMPLE_RE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?[ \t]+(\S+)([ \t]+-?\d+)?$"
)


def scrape(http: httpx.Client) -> tuple[str, dict[str, float]]:
    """GET /metrics; returns the text and each sample name's value summed over its label sets."""
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    totals: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return r.text, totals


def token_ids_of(logprobs_tokens: list[str]) -> list[int]:
    ids = []
    for tok in logprobs_tokens:
        m = TOKEN_ID_RE.match(tok)
        assert m, f"token {tok!r} is not of the form token_id:N"
        ids.append(int(m.group(1)))
    return ids


def greedy_ids(client: OpenAI, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """Greedy text and token ids (through logprobs + return_tokens_as_token_ids)."""
    r = complete(
        client,
        prompt,
        max_tokens=max_tokens,
        logprobs=1,
        extra={**IGNORE_EOS, "return_tokens_as_token_ids": True},
    )
    return r.choices[0].text, token_ids_of(r.choices[0].logprobs.tokens)


def pick_stop(text: str) -> tuple[str, int] | None:
    """A short printable substring from the middle of `text` whose first occurrence is not at 0."""
    n = len(text)
    for width in (3, 2, 4, 1):
        for i in sorted(range(1, n - width), key=lambda i: abs(i - n // 2)):
            s = text[i : i + width]
            if "\ufffd" in s or not s.strip() or not s.isprintable():
                continue
            idx = text.find(s)
            if idx > 0:
                return s, idx
    return None


# greedy text of random weights may degenerate into repeating one token; try a few prompts
ALT_PROMPTS = [PROMPT, "Once upon a time", "The capital of France is", "1, 2, 3, 4,"]


def stop_across_tokens(text: str, tokens: list[str]) -> tuple[str, int] | None:
    """A short printable stop string that straddles a token boundary near the middle of `text`
    (so a streaming server must hold back a partial match), first occurring there."""
    if "".join(tokens) != text:
        return None
    bounds, pos = [], 0
    for t in tokens[:-1]:
        pos += len(t)
        bounds.append(pos)
    for b in sorted(bounds, key=lambda b: abs(b - len(text) // 2)):
        for left, right in ((1, 1), (2, 1), (1, 2), (2, 2)):
            if b - left < 1 or b + right > len(text):
                continue
            s = text[b - left : b + right]
            if "\ufffd" in s or not s.strip() or not s.isprintable():
                continue
            if text.find(s) == b - left:
                return s, b - left
    return None


def completion_with_stop(client: OpenAI) -> tuple[str, str, str, int]:
    """(prompt, its 16-token greedy text, a stop string from its middle, where that first occurs).
    The stop string straddles two tokens where the text allows it."""
    texts, fallback = [], None
    for p in ALT_PROMPTS:
        r = complete(client, p, max_tokens=16, logprobs=1, extra=IGNORE_EOS)
        text = r.choices[0].text
        found = stop_across_tokens(text, r.choices[0].logprobs.tokens)
        if found:
            return p, text, *found
        found = pick_stop(text)
        if found and fallback is None:
            fallback = (p, text, *found)
        texts.append(text)
    if fallback:
        return fallback
    pytest.fail(f"no usable stop string in the greedy texts {texts!r}")


def chat_with_stop(client: OpenAI) -> tuple[list, str, str, int]:
    texts, fallback = [], None
    for p in ALT_PROMPTS:
        messages = [{"role": "user", "content": p}]
        r = chat(client, messages, max_tokens=16, logprobs=True, extra=IGNORE_EOS)
        text = r.choices[0].message.content
        found = stop_across_tokens(text, [e.token for e in r.choices[0].logprobs.content])
        if found:
            return messages, text, *found
        found = pick_stop(text)
        if found and fallback is None:
            fallback = (messages, text, *found)
        texts.append(text)
    if fallback:
        return fallback
    pytest.fail(f"no usable stop string in the greedy texts {texts!r}")


def completion_with_new_token(client: OpenAI, max_tokens: int) -> tuple[str, list[int], int]:
    """(prompt, its greedy token ids, an index k >= 1, near the middle, where ids[k] first occurs)."""
    seen = []
    for p in ALT_PROMPTS:
        _, ids = greedy_ids(client, p, max_tokens)
        for k in sorted(range(1, len(ids)), key=lambda i: abs(i - len(ids) // 2)):
            if ids[k] not in ids[:k]:
                return p, ids, k
        seen.append(ids)
    pytest.fail(f"greedy outputs repeat a single token: {seen}")


# ------------------------------------------------------------------------------------------------
# health, version, models, tokenizer endpoints
# ------------------------------------------------------------------------------------------------


def test_health(http):
    assert http.get("/health").status_code == 200


def test_version(http):
    r = http.get("/version")
    assert r.status_code == 200, r.text
    v = r.json()["version"]
    assert isinstance(v, str) and v


def test_models_list_shape(http):
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert isinstance(body["data"], list) and len(body["data"]) >= 1
    card = next(m for m in body["data"] if m["id"] == MODEL)
    assert card["object"] == "model"
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000
    assert isinstance(card["owned_by"], str) and card["owned_by"]
    assert isinstance(card["root"], str) and card["root"]
    assert "parent" in card and card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN


def test_models_list_openai_client(client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids


def test_tokenize_prompt(http):
    body = tokenize(http, prompt="Hello world, how are you?")
    assert set(body) >= {"count", "tokens", "max_model_len"}, body
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["count"] == len(body["tokens"]) > 0
    assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in body["tokens"])


def test_tokenize_chat_messages(http):
    short = tokenize(http, messages=[{"role": "user", "content": "Hi"}])
    assert short["count"] == len(short["tokens"])
    longer = tokenize(http, messages=[{"role": "user", "content": "Hi there, how are you today?"}])
    assert longer["count"] > short["count"]
    # the chat template (ChatML with a default system prompt) is applied
    plain = token_count(http, prompt="Hi")
    assert short["count"] > plain + 10


def test_detokenize_round_trip(http):
    text = "Hello world, how are you?"
    tokens = tokenize(http, prompt=text)["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert "prompt" in r.json(), r.json()
    out = r.json()["prompt"]
    # the fixture tokenizer prepends BOS; a server may render it or skip it
    assert out in (text, BOS_TEXT + text), out
    # and text -> ids -> text -> ids is stable
    assert tokenize(http, prompt=out.removeprefix(BOS_TEXT))["tokens"] == tokens


# ------------------------------------------------------------------------------------------------
# completions
# ------------------------------------------------------------------------------------------------


def test_completion_basic(client, http):
    r = complete(client, max_tokens=8, extra=IGNORE_EOS)
    assert r.id.startswith("cmpl-"), r.id
    assert r.object == "text_completion"
    assert r.model == MODEL
    assert isinstance(r.created, int) and abs(r.created - time.time()) < 3600
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert isinstance(c.text, str) and c.text
    assert c.finish_reason == "length"
    check_usage(r.usage, prompt_tokens=token_count(http, prompt=PROMPT), completion_tokens=8)


def test_completion_finish_reason_without_ignore_eos(client):
    r = complete(client, max_tokens=12)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    u = check_usage(r.usage)
    if c.finish_reason == "length":
        assert u["completion_tokens"] == 12
    else:
        assert u["completion_tokens"] <= 12


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "length"
    check_usage(r.usage, completion_tokens=16)


def test_completion_stream_equals_non_stream(client):
    full = complete(client, max_tokens=12, extra=IGNORE_EOS)
    stream = complete(client, max_tokens=12, extra=IGNORE_EOS, stream=True)
    parts, finish, ids = [], [], set()
    for chunk in stream:
        ids.add(chunk.id)
        assert chunk.object == "text_completion"
        assert chunk.model == MODEL
        for c in chunk.choices:
            assert c.index == 0
            parts.append(c.text)
            if c.finish_reason is not None:
                finish.append(c.finish_reason)
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert "".join(parts) == full.choices[0].text
    assert finish == ["length"]


def test_completion_prompt_list_of_strings(client, http):
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,"]
    singles = [complete(client, p, max_tokens=6, extra=IGNORE_EOS).choices[0].text for p in prompts]
    r = complete(client, prompts, max_tokens=6, extra=IGNORE_EOS)
    assert r.id.startswith("cmpl-")
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == singles
    assert all(c.finish_reason == "length" for c in r.choices)
    prompt_tokens = sum(token_count(http, prompt=p) for p in prompts)
    check_usage(r.usage, prompt_tokens=prompt_tokens, completion_tokens=18)


def test_completion_prompt_token_ids(client, http):
    ids = tokenize(http, prompt=PROMPT)["tokens"]
    by_text = complete(client, PROMPT, max_tokens=6, extra=IGNORE_EOS)
    by_ids = complete(client, ids, max_tokens=6, extra=IGNORE_EOS)
    assert by_ids.choices[0].text == by_text.choices[0].text
    check_usage(by_ids.usage, prompt_tokens=len(ids), completion_tokens=6)


def test_completion_prompt_list_of_token_id_lists(client, http):
    prompts = ["Once upon a time", "The capital of France is"]
    id_lists = [tokenize(http, prompt=p)["tokens"] for p in prompts]
    singles = [complete(client, p, max_tokens=5, extra=IGNORE_EOS).choices[0].text for p in prompts]
    r = complete(client, id_lists, max_tokens=5, extra=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == singles
    check_usage(r.usage, prompt_tokens=sum(map(len, id_lists)), completion_tokens=10)


def test_completion_echo(client):
    plain = complete(client, max_tokens=5, extra=IGNORE_EOS).choices[0].text
    r = complete(client, max_tokens=5, echo=True, extra=IGNORE_EOS)
    assert r.choices[0].text.startswith(PROMPT)
    assert r.choices[0].text == PROMPT + plain
    check_usage(r.usage, completion_tokens=5)


def test_completion_echo_with_logprobs_streamed_equals_non_streamed(http):
    # the prompt's tokens and logprobs lead the first streamed chunk, as the whole response has them
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 1, **IGNORE_EOS}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = stream_raw(http, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events if e.get("choices")]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None  # the prompt's first token has none
    for key in ("tokens", "token_logprobs"):
        streamed = [x for c in chunks for x in c["logprobs"][key]]
        assert len(streamed) == len(whole["logprobs"][key]), key
        if key == "tokens":
            assert streamed == whole["logprobs"][key]
        else:
            assert [x is None for x in streamed] == [x is None for x in whole["logprobs"][key]]
            assert [x for x in streamed if x is not None] == pytest.approx(
                [x for x in whole["logprobs"][key] if x is not None], abs=1e-4)


def test_completion_logprobs(client):
    r = complete(client, max_tokens=6, logprobs=2, extra=IGNORE_EOS)
    c = r.choices[0]
    lp = c.logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs)
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict)
        # 2 alternatives; keys are decoded strings, so two tokens that both decode to "\ufffd" merge
        assert 1 <= len(top) <= 2, top
        assert all(v <= 0.0 for v in top.values())
        assert tok in top, (tok, top)
        if "\ufffd" not in tok:
            # greedy: the chosen token is the most likely one
            assert max(top.values()) == pytest.approx(logprob, abs=1e-4), (tok, logprob, top)
    assert all(isinstance(o, int) for o in lp.text_offset)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


# ------------------------------------------------------------------------------------------------
# chat completions
# ------------------------------------------------------------------------------------------------


def test_chat_basic(client, http):
    r = chat(client, max_tokens=8, extra=IGNORE_EOS)
    assert r.id.startswith("chatcmpl-"), r.id
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert isinstance(r.created, int) and abs(r.created - time.time()) < 3600
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason == "length"
    check_usage(r.usage, prompt_tokens=token_count(http, messages=MESSAGES), completion_tokens=8)


def test_chat_prompt_tokens_match_tokenize(client, http):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    r = chat(client, messages, max_tokens=2, extra=IGNORE_EOS)
    check_usage(r.usage, prompt_tokens=token_count(http, messages=messages), completion_tokens=2)


def test_chat_finish_reason_without_ignore_eos(client):
    r = chat(client, max_tokens=12)
    c = r.choices[0]
    u = check_usage(r.usage)
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "length":
        assert u["completion_tokens"] == 12
    else:
        assert u["completion_tokens"] <= 12


def test_chat_default_max_tokens_is_rest_of_context(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS
    )
    assert r.choices[0].finish_reason == "length"
    u = check_usage(r.usage)
    assert u["total_tokens"] == MAX_MODEL_LEN


def test_chat_stream_equals_non_stream(client):
    full = chat(client, max_tokens=12, extra=IGNORE_EOS)
    stream = chat(
        client, max_tokens=12, extra=IGNORE_EOS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert all(ch.model == MODEL for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert text == full.choices[0].message.content
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    check_usage(chunks[-1].usage, prompt_tokens=full.usage.prompt_tokens, completion_tokens=12)


def test_chat_max_completion_tokens(client):
    by_max_tokens = chat(client, max_tokens=5, extra=IGNORE_EOS)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    assert r.choices[0].finish_reason == "length"
    check_usage(r.usage, completion_tokens=5)
    assert r.choices[0].message.content == by_max_tokens.choices[0].message.content


def test_chat_content_parts_equal_string_content(client):
    as_string = chat(client, [{"role": "user", "content": "Hi there"}], max_tokens=6, extra=IGNORE_EOS)
    as_parts = chat(
        client,
        [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        max_tokens=6,
        extra=IGNORE_EOS,
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_chat_logprobs(client):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=3, extra=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry.token, str)
        assert isinstance(entry.logprob, float) and entry.logprob <= 0.0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes) == entry.token.encode("utf-8")
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert all(x <= 0.0 for x in top)
        assert all(isinstance(t.token, str) and isinstance(t.bytes, list) for t in entry.top_logprobs)
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(top[0], abs=1e-4)
    # the logprob tokens spell the content (unless a character is split across tokens)
    if not any("\ufffd" in e.token for e in content):
        assert "".join(e.token for e in content) == r.choices[0].message.content


# ------------------------------------------------------------------------------------------------
# raw SSE framing
# ------------------------------------------------------------------------------------------------


def test_chat_stream_sse_framing(http, client):
    full = chat(client, max_tokens=6, extra=IGNORE_EOS)
    events = stream_raw(
        http,
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert len(events) >= 3
    for ev in events:
        assert ev["object"] == "chat.completion.chunk"
        assert ev["id"].startswith("chatcmpl-") and ev["id"] == events[0]["id"]
        assert ev["model"] == MODEL
        assert isinstance(ev["created"], int)
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    # the last chunk carries usage and no choices; the others carry no usage
    last = events[-1]
    assert last["choices"] == []
    check_usage(last["usage"], prompt_tokens=full.usage.prompt_tokens, completion_tokens=6)
    content_chunks = events[:-1]
    assert all(ev["choices"] for ev in content_chunks)
    assert all(ev.get("usage") is None for ev in content_chunks)
    # finish_reason rides on the last content chunk, and only there
    finishes = [ev["choices"][0].get("finish_reason") for ev in content_chunks]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1]), finishes
    text = "".join(ev["choices"][0]["delta"].get("content") or "" for ev in content_chunks)
    assert text == full.choices[0].message.content


def test_chat_stream_without_include_usage(http):
    events = stream_raw(
        http,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert all(ev["choices"] for ev in events), "a chunk without choices although usage was not asked"
    assert all(ev.get("usage") is None for ev in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_sse_framing(http, client):
    full = complete(client, max_tokens=6, extra=IGNORE_EOS)
    events = stream_raw(
        http,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    for ev in events:
        assert ev["object"] == "text_completion"
        assert ev["id"].startswith("cmpl-") and ev["id"] == events[0]["id"]
        assert ev["model"] == MODEL
    last = events[-1]
    assert last["choices"] == []
    check_usage(last["usage"], prompt_tokens=full.usage.prompt_tokens, completion_tokens=6)
    content_chunks = events[:-1]
    assert content_chunks and all(ev["choices"] for ev in content_chunks)
    assert all(ev.get("usage") is None for ev in content_chunks)
    finishes = [ev["choices"][0].get("finish_reason") for ev in content_chunks]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1]), finishes
    assert "".join(ev["choices"][0]["text"] for ev in content_chunks) == full.choices[0].text


# ------------------------------------------------------------------------------------------------
# sampling: n, seed, stop, vLLM extensions
# ------------------------------------------------------------------------------------------------


def _sampled_texts(client, kind: str, seed: int) -> list[str]:
    kw = dict(n=3, seed=seed, temperature=1.0, max_tokens=12, extra_body=IGNORE_EOS)
    if kind == "chat":
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        choices = sorted(r.choices, key=lambda c: c.index)
        assert [c.index for c in choices] == [0, 1, 2]
        check_usage(r.usage, completion_tokens=36)
        return [c.message.content for c in choices]
    r = client.completions.create(model=MODEL, prompt=PROMPT, **kw)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2]
    check_usage(r.usage, completion_tokens=36)
    return [c.text for c in choices]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_n_with_seed_is_reproducible(client, kind):
    first = _sampled_texts(client, kind, seed=5)
    assert len(first) == 3
    assert len(set(first)) > 1, f"the n=3 samples are all identical: {first}"
    assert _sampled_texts(client, kind, seed=5) == first
    assert _sampled_texts(client, kind, seed=6) != first


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_stop_string(client, stream):
    prompt, text, stop, idx = completion_with_stop(client)
    r = complete(client, prompt, max_tokens=16, stop=stop, extra=IGNORE_EOS, stream=stream)
    if stream:
        chunks = list(r)
        out = "".join(c.text for ch in chunks for c in ch.choices)
        finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finishes == ["stop"]
    else:
        out = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens <= 16
    assert out == text[:idx], f"stop={stop!r} full={text!r}"


def test_stop_string_list_and_include_stop_str(client):
    prompt, text, stop, idx = completion_with_stop(client)
    r = complete(
        client, prompt, max_tokens=16, stop=["\u2603 not there \u2603", stop], extra=IGNORE_EOS
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:idx], f"stop={stop!r} full={text!r}"
    r = complete(
        client,
        prompt,
        max_tokens=16,
        stop=stop,
        extra={**IGNORE_EOS, "include_stop_str_in_output": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: idx + len(stop)], f"stop={stop!r} full={text!r}"


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_chat_stop_string(client, stream):
    messages, text, stop, idx = chat_with_stop(client)
    r = chat(client, messages, max_tokens=16, stop=[stop], extra=IGNORE_EOS, stream=stream)
    if stream:
        chunks = list(r)
        out = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finishes == ["stop"]
    else:
        out = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    assert out == text[:idx], f"stop={stop!r} full={text!r}"


def test_stop_token_ids(client):
    prompt, ids, k = completion_with_new_token(client, 12)
    before = complete(client, prompt, max_tokens=k, extra=IGNORE_EOS).choices[0].text
    r = complete(client, prompt, max_tokens=12, extra={**IGNORE_EOS, "stop_token_ids": [ids[k]]})
    assert r.choices[0].finish_reason == "stop"
    check_usage(r.usage, completion_tokens=k + 1)  # the stop token is generated and counted
    assert r.choices[0].text == before  # ... but its text is not returned


def test_min_tokens_suppresses_stop_tokens(client):
    _, ids = greedy_ids(client, PROMPT, 4)
    extra = {**IGNORE_EOS, "stop_token_ids": [ids[0]]}
    r = complete(client, max_tokens=8, extra=extra)
    assert r.choices[0].finish_reason == "stop"
    check_usage(r.usage, completion_tokens=1)
    r = complete(client, max_tokens=8, extra={**extra, "min_tokens": 4})
    assert r.usage.completion_tokens >= 4, r.usage


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": 5},
        {"min_p": 0.1},
        {"repetition_penalty": 1.2},
        {"min_tokens": 2},
        {"ignore_eos": True},
        {"stop_token_ids": [EOS_ID, 7]},
        {"skip_special_tokens": False},
        {"include_stop_str_in_output": True},
        {"return_tokens_as_token_ids": True},
    ],
    ids=lambda e: next(iter(e)),
)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_vllm_extensions_accepted(client, kind, extra):
    kw = dict(max_tokens=4, temperature=0.8, seed=1, extra=extra)
    if kind == "chat":
        r = chat(client, **kw)
        assert r.object == "chat.completion"
        assert isinstance(r.choices[0].message.content, str)
    else:
        r = complete(client, **kw)
        assert r.object == "text_completion"
        assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    check_usage(r.usage)
    assert 1 <= r.usage.completion_tokens <= 4


def test_standard_sampling_params_accepted(client):
    r = chat(
        client,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"100": 1.0},
        user="someone",
        seed=3,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    check_usage(r.usage)


def test_unknown_fields_are_ignored(http):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "no_such_field": {"x": 1}},
    )
    assert r.status_code == 200, r.text


def test_top_k_1_is_greedy(client):
    greedy = complete(client, max_tokens=10, extra=IGNORE_EOS).choices[0].text
    r = complete(client, max_tokens=10, temperature=1.0, seed=11, extra={**IGNORE_EOS, "top_k": 1})
    assert r.choices[0].text == greedy


def test_min_p_1_is_greedy(client):
    greedy = complete(client, max_tokens=10, extra=IGNORE_EOS).choices[0].text
    r = complete(client, max_tokens=10, temperature=1.0, seed=11, extra={**IGNORE_EOS, "min_p": 1.0})
    assert r.choices[0].text == greedy


def test_logit_bias_forces_token(client, http):
    piece = detokenize(http, [500])
    r = complete(client, max_tokens=4, logit_bias={"500": 100}, extra=IGNORE_EOS)
    assert r.choices[0].text == piece * 4


def test_skip_special_tokens(client):
    bias = {str(SPECIAL_TOKEN_ID): 100}
    skipped = complete(client, max_tokens=3, logit_bias=bias, extra=IGNORE_EOS)
    assert SPECIAL_TOKEN_TEXT not in skipped.choices[0].text
    assert skipped.choices[0].text.strip() == ""
    check_usage(skipped.usage, completion_tokens=3)
    kept = complete(
        client, max_tokens=3, logit_bias=bias, extra={**IGNORE_EOS, "skip_special_tokens": False}
    )
    assert SPECIAL_TOKEN_TEXT in kept.choices[0].text


def test_return_tokens_as_token_ids_completions(client):
    r = complete(
        client,
        max_tokens=5,
        logprobs=2,
        extra={**IGNORE_EOS, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    ids = token_ids_of(lp.tokens)
    assert len(ids) == 5 and all(0 <= i < VOCAB_SIZE for i in ids)
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) == 2, top  # ids are unique keys, so exactly 2 alternatives
        token_ids_of(list(top))
        assert tok in top


def test_return_tokens_as_token_ids_chat(client):
    r = chat(
        client,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra={**IGNORE_EOS, "return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    ids = token_ids_of([e.token for e in content])
    assert len(ids) == 5 and all(0 <= i < VOCAB_SIZE for i in ids)
    for e in content:
        assert len(e.top_logprobs) == 2
        token_ids_of([t.token for t in e.top_logprobs])


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_TEXT = "hello " * 300  # far more than 256 tokens with the fixture tokenizer


def _chat(**kw):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kw}


def _cmpl(**kw):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kw}


BAD_REQUESTS = [
    # (id, path, json body or raw bytes, status, substring of the message)
    ("chat-malformed-json", CHAT, b'{"model": "tiny-qwen", "messages": [{"role": "user"', 400, None),
    ("cmpl-malformed-json", COMPLETIONS, b'{"model": "tiny-qwen", "prompt": "hi",,}', 400, None),
    ("chat-not-an-object", CHAT, b"[1, 2, 3]", 400, None),
    ("chat-temperature-type", CHAT, _chat(temperature="hot"), 400, None),
    ("cmpl-temperature-type", COMPLETIONS, _cmpl(temperature="hot"), 400, None),
    ("chat-max-tokens-type", CHAT, _chat(max_tokens="ten"), 400, None),
    ("chat-messages-type", CHAT, {"model": MODEL, "messages": "hello"}, 400, None),
    ("cmpl-prompt-type", COMPLETIONS, _cmpl(prompt={"text": "hi"}), 400, None),
    ("chat-temperature-negative", CHAT, _chat(temperature=-1), 400, None),
    ("cmpl-temperature-negative", COMPLETIONS, _cmpl(temperature=-1), 400, None),
    ("chat-top-p-2", CHAT, _chat(top_p=2), 400, None),
    ("cmpl-top-p-2", COMPLETIONS, _cmpl(top_p=2), 400, None),
    ("chat-n-0", CHAT, _chat(n=0), 400, None),
    ("cmpl-n-0", COMPLETIONS, _cmpl(n=0), 400, None),
    ("cmpl-logprobs-50", COMPLETIONS, _cmpl(logprobs=50), 400, None),
    ("chat-top-logprobs-50", CHAT, _chat(logprobs=True, top_logprobs=50), 400, None),
    ("chat-top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=3), 400, None),
    ("chat-max-tokens-negative", CHAT, _chat(max_tokens=-1), 400, None),
    ("chat-presence-penalty-5", CHAT, _chat(presence_penalty=5), 400, None),
    ("chat-repetition-penalty-0", CHAT, _chat(repetition_penalty=0), 400, None),
    ("chat-min-p-1.5", CHAT, _chat(min_p=1.5), 400, None),
    ("chat-empty-messages", CHAT, {"model": MODEL, "messages": []}, 400, None),
    ("chat-missing-messages", CHAT, {"model": MODEL}, 400, None),
    ("chat-stream-invalid", CHAT, _chat(temperature=-1, stream=True), 400, None),
    (
        "chat-prompt-over-context",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]},
        400,
        CONTEXT_ERROR,
    ),
    (
        "cmpl-prompt-over-context",
        COMPLETIONS,
        _cmpl(prompt=[300] * 300),
        400,
        CONTEXT_ERROR,
    ),
    (
        "cmpl-prompt-plus-max-tokens-over-context",
        COMPLETIONS,
        _cmpl(prompt=[300] * 200, max_tokens=100),
        400,
        CONTEXT_ERROR,
    ),
    ("chat-max-tokens-over-context", CHAT, _chat(max_tokens=300), 400, CONTEXT_ERROR),
    (
        "cmpl-stream-prompt-over-context",
        COMPLETIONS,
        _cmpl(prompt=[300] * 300, stream=True),
        400,
        CONTEXT_ERROR,
    ),
    ("chat-unknown-model", CHAT, _chat(model="nope"), 404, "The model `nope` does not exist."),
    ("cmpl-unknown-model", COMPLETIONS, _cmpl(model="nope"), 404, "The model `nope` does not exist."),
]


@pytest.mark.parametrize(
    "path,body,status,contains", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request(http, path, body, status, contains):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, status, contains)
    assert_still_serving(http)


def test_context_error_wording(http):
    r = http.post(COMPLETIONS, json=_cmpl(prompt=[300] * 200, max_tokens=100))
    err = assert_error(r, 400, CONTEXT_ERROR)
    assert err["message"].startswith("This model's maximum context length is 256 tokens."), err


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert chat(client, max_tokens=1).choices[0].finish_reason in ("stop", "length")


def test_body_too_large_is_413(server, http):
    size = 50 * 1024 * 1024
    head, tail = b'{"model": "tiny-qwen", "prompt": "', b'", "max_tokens": 1}'
    body = head + b"a" * (size - len(head) - len(tail)) + tail
    resp = post_raw_body(server.host, server.port, COMPLETIONS, body)
    assert resp is not None, "no HTTP response to a 50 MB body"
    assert_error(resp, 413)
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------------
# authentication (second instance, --api-key sekrit)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}, {"Authorization": "Basic sekrit"}],
    ids=["missing", "wrong-key", "no-scheme", "basic"],
)
def test_auth_rejects_bad_key(auth_server, headers):
    with httpx.Client(base_url=auth_server.url, timeout=60) as c:
        assert_error(c.get("/v1/models", headers=headers), 401)
        assert_error(c.post(COMPLETIONS, json=_cmpl(max_tokens=1), headers=headers), 401)
        assert_error(c.post(CHAT, json=_chat(max_tokens=1), headers=headers), 401)
        assert_error(c.post(CHAT, json=_chat(max_tokens=1, stream=True), headers=headers), 401)
        # still serving
        good = c.post(COMPLETIONS, json=_cmpl(max_tokens=1), headers={"Authorization": "Bearer sekrit"})
        assert good.status_code == 200, good.text


def test_auth_accepts_good_key_and_leaves_health_metrics_open(auth_server):
    with httpx.Client(base_url=auth_server.url, timeout=60) as c:
        ok = {"Authorization": "Bearer sekrit"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.post(CHAT, json=_chat(max_tokens=2), headers=ok)
        assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200
        m = c.get("/metrics")
        assert m.status_code == 200
        assert "vllm:num_requests_running" in m.text


def test_auth_with_openai_client(auth_server):
    good = OpenAI(base_url=f"{auth_server.url}/v1", api_key="sekrit", max_retries=0)
    bad = OpenAI(base_url=f"{auth_server.url}/v1", api_key="wrong", max_retries=0)
    try:
        r = good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    finally:
        good.close()
        bad.close()


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
]


def test_metrics_names_and_counts(http, client):
    # make sure every metric has seen at least one request
    complete(client, max_tokens=2)
    _, before = scrape(http)
    prompt_tokens = token_count(http, prompt=PROMPT)
    r = complete(client, max_tokens=5, extra=IGNORE_EOS)
    check_usage(r.usage, prompt_tokens=prompt_tokens, completion_tokens=5)
    text, after = scrape(http)

    for name in METRIC_NAMES:
        assert name in text, f"{name} missing from /metrics"
    assert (
        "vllm:inter_token_latency_seconds" in text or "vllm:time_per_output_token_seconds" in text
    ), "no inter-token latency histogram"

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0


def test_metrics_content_type(http):
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers.get("content-type", "").startswith("text/plain")


# ------------------------------------------------------------------------------------------------
# concurrency and disconnects
# ------------------------------------------------------------------------------------------------


def test_64_concurrent_streaming_chats_match_sequential(server, client):
    prompts = [f"Request {i}: say something about the number {i * 7 + 1}." for i in range(64)]
    expected = []
    for p in prompts:
        r = chat(client, [{"role": "user", "content": p}], max_tokens=8)
        expected.append((r.choices[0].message.content, r.choices[0].finish_reason))

    async def one(ac: AsyncOpenAI, prompt: str):
        stream = await ac.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        parts, finish = [], None
        async for chunk in stream:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(parts), finish

    async def run_all():
        ac = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, p) for p in prompts))
        finally:
            await ac.close()

    got = asyncio.run(run_all())
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, (
        f"{len(mismatches)} of 64 differ, e.g. #{mismatches[0]}: "
        f"concurrent {got[mismatches[0]]!r} vs sequential {expected[mismatches[0]]!r}"
    )


def test_client_disconnect_aborts_request(server, http):
    _, before = scrape(http)
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if chunks == 2:
                        break
    assert chunks == 2  # leaving the blocks closed the connection mid-stream

    deadline = time.monotonic() + 10
    while True:
        _, now = scrape(http)
        running = now.get("vllm:num_requests_running")
        waiting = now.get("vllm:num_requests_waiting")
        kv = now.get("vllm:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and kv == 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"10 s after the disconnect: running={running} waiting={waiting} kv_cache_usage={kv}"
            )
        time.sleep(0.1)

    generated = now.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
    if generated >= 200:
        warnings.warn(
            "the 200-token request finished before the disconnect was seen; abort path not exercised"
        )
    assert_still_serving(http)
