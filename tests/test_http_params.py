"""Request fields: nothing that changes the output is silently ignored, type errors name the
field, and vLLM's `prompt_logprobs`, `best_of` and chat `echo` are served."""

from __future__ import annotations

import httpx
import pytest

from support.http_checks import MODEL, assert_error, assert_still_serving, parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB_SIZE = 1000
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **kw}


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **kw}


def post_ok(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(http: httpx.Client, **body) -> list[int]:
    return post_ok(http, "/tokenize", {"model": MODEL, **body})["tokens"]


# ------------------------------------------------------------------------------------------------
# no silent ignores: fields this server does not serve are refused, naming the field
# ------------------------------------------------------------------------------------------------

UNSERVED = [
    # (id, path, body, the field named in `param` and in the message)
    ("chat-functions", CHAT, _chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("chat-function_call", CHAT, _chat(function_call="auto"), "function_call"),
    ("chat-tool_choice-without-tools", CHAT, _chat(tool_choice="auto"), "tool_choice"),
    ("chat-modalities-audio", CHAT, _chat(modalities=["text", "audio"]), "modalities"),
    ("cmpl-prompt_logprobs-stream", COMPLETIONS, _cmpl(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("chat-best_of-below-n", CHAT, _chat(n=3, best_of=2), "best_of"),
    ("cmpl-best_of-below-n", COMPLETIONS, _cmpl(n=3, best_of=2), "best_of"),
    ("chat-best_of-stream", CHAT, _chat(n=1, best_of=2, stream=True), "best_of"),
    ("cmpl-best_of-stream", COMPLETIONS, _cmpl(n=1, best_of=2, stream=True), "best_of"),
    ("chat-chat_template", CHAT, _chat(chat_template="{{ messages[0].content }}"), "chat_template"),
    ("chat-stream_options-without-stream", CHAT, _chat(stream_options={"include_usage": True}), "stream_options"),
    ("cmpl-stream_options-stream-false", COMPLETIONS, _cmpl(stream=False, stream_options={"include_usage": True}),
     "stream_options"),
]


@pytest.mark.parametrize("path,body,field", [c[1:] for c in UNSERVED], ids=[c[0] for c in UNSERVED])
def test_unserved_fields_are_refused(http, path, body, field):
    err = assert_error(http.post(path, json=body), 400, param=field)
    assert field in err["message"], err


@pytest.mark.parametrize(
    "path,body",
    [
        (COMPLETIONS, _cmpl(response_format={"type": "text"})),
        (CHAT, _chat(modalities=["text"])),
        (CHAT, _chat(n=2, best_of=2, stream=True)),
        (CHAT, _chat(tool_choice="none")),
    ],
    ids=[
        "cmpl-response_format-text",
        "chat-modalities-text",
        "chat-best_of-equals-n-stream",
        "chat-tool_choice-none",
    ],
)
def test_served_values_of_those_fields_are_accepted(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------
# type errors name the field, in words a client can act on
# ------------------------------------------------------------------------------------------------

LEAKED_INTERNALS = ("untagged", "variant", "f64", "i64", "u64", "line 1 column")

TYPE_ERRORS = [
    # (id, path, body, param, substring of the message)
    ("temperature-string", CHAT, _chat(temperature="hot"), "temperature", "`temperature` must be a number"),
    ("max_tokens-float", CHAT, _chat(max_tokens=1.5), "max_tokens", "must be an integer"),
    ("n-string", CHAT, _chat(n="2"), "n", None),
    ("stop-number", CHAT, _chat(stop=5), "stop", "a string or a list of strings"),
    ("messages-string", CHAT, {"model": MODEL, "messages": "hi"}, "messages", None),
    ("prompt-object", COMPLETIONS, _cmpl(prompt={"a": 1}), "prompt", None),
    ("logit_bias-list", CHAT, _chat(logit_bias=[1]), "logit_bias", None),
    ("cmpl-temperature-string", COMPLETIONS, _cmpl(temperature="hot"), "temperature", "must be a number"),
    ("cmpl-max_tokens-float", COMPLETIONS, _cmpl(max_tokens=1.5), "max_tokens", "must be an integer"),
    ("missing-messages", CHAT, {"model": MODEL, "max_tokens": 2}, "messages", "required"),
]


def _check_wording(message: str) -> None:
    low = message.lower()
    leaked = [w for w in LEAKED_INTERNALS if w in low]
    assert not leaked, f"the message leaks parser internals {leaked}: {message!r}"


@pytest.mark.parametrize(
    "path,body,param,contains", [c[1:] for c in TYPE_ERRORS], ids=[c[0] for c in TYPE_ERRORS]
)
def test_type_errors_name_the_field(http, path, body, param, contains):
    err = assert_error(http.post(path, json=body), 400, contains, param=param)
    _check_wording(err["message"])


def test_type_error_inside_a_message_names_its_path(http):
    body = {"model": MODEL, "messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}
    err = assert_error(http.post(CHAT, json=body), 400)
    assert isinstance(err["param"], str) and err["param"].startswith("messages"), err
    _check_wording(err["message"])
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------------
# prompt_logprobs
# ------------------------------------------------------------------------------------------------


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_prompt_logprobs(plp: object, tokens: list[int], k: int) -> None:
    """vLLM's shape: None for the first position, then {token id: {logprob, rank, decoded_token}}
    with the prompt's own token and the top `k` alternatives."""
    assert isinstance(plp, list), plp
    assert len(plp) == len(tokens), (len(plp), len(tokens))
    assert plp[0] is None, plp[0]
    for pos in range(1, len(tokens)):
        entry, actual = plp[pos], str(tokens[pos])
        assert isinstance(entry, dict), (pos, entry)
        assert actual in entry, f"position {pos}: prompt token {actual} not in {sorted(entry)}"
        for key, v in entry.items():
            assert key.isdigit() and int(key) < VOCAB_SIZE, (pos, key)
            assert _is_number(v.get("logprob")) and v["logprob"] <= 0, (pos, key, v)
            rank = v.get("rank")
            assert isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1, (pos, key, v)
            assert isinstance(v.get("decoded_token"), str), (pos, key, v)
        top = sorted(entry.values(), key=lambda v: v["rank"])
        ranks_top = [v["rank"] for v in top if v["rank"] <= k]
        assert ranks_top == list(range(1, k + 1)), f"position {pos}: ranks {[v['rank'] for v in top]}"
        others = [v for key, v in entry.items() if key != actual]
        assert all(v["rank"] <= k for v in others), (pos, entry)
        assert len(entry) == k + (0 if entry[actual]["rank"] <= k else 1), (pos, entry)
        logprobs = [v["logprob"] for v in top]
        assert all(a >= b - 1e-5 for a, b in zip(logprobs, logprobs[1:])), (pos, entry)


def test_completion_prompt_logprobs(http):
    tokens = tokenize(http, prompt=PROMPT, add_special_tokens=True)
    body = post_ok(http, COMPLETIONS, _cmpl(max_tokens=1, prompt_logprobs=2))
    assert body["usage"]["prompt_tokens"] == len(tokens), (body["usage"], tokens)
    check_prompt_logprobs(body["choices"][0].get("prompt_logprobs"), tokens, 2)


def test_completion_prompt_logprobs_0_is_the_prompt_tokens_only(http):
    tokens = tokenize(http, prompt=PROMPT, add_special_tokens=True)
    body = post_ok(http, COMPLETIONS, _cmpl(max_tokens=1, prompt_logprobs=0))
    plp = body["choices"][0].get("prompt_logprobs")
    check_prompt_logprobs(plp, tokens, 0)
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], tokens[1:])), plp


def test_chat_prompt_logprobs_are_top_level(http):
    tokens = tokenize(http, messages=MESSAGES, add_generation_prompt=True)
    body = post_ok(http, CHAT, _chat(max_tokens=1, prompt_logprobs=1))
    assert body["usage"]["prompt_tokens"] == len(tokens), (body["usage"], len(tokens))
    check_prompt_logprobs(body.get("prompt_logprobs"), tokens, 1)


def test_prompt_logprobs_above_20_is_refused(http):
    assert_error(http.post(COMPLETIONS, json=_cmpl(prompt_logprobs=21)), 400)
    assert_error(http.post(CHAT, json=_chat(prompt_logprobs=21)), 400)


# ------------------------------------------------------------------------------------------------
# best_of
# ------------------------------------------------------------------------------------------------

SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 8}


def _completion_samples(choices: list[dict]) -> list[tuple[str, float]]:
    return [(c["text"], sum(c["logprobs"]["token_logprobs"])) for c in choices]


def _chat_samples(choices: list[dict]) -> list[tuple[str, float]]:
    return [
        (c["message"]["content"], sum(t["logprob"] for t in c["logprobs"]["content"])) for c in choices
    ]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_best_of_returns_the_most_likely_sample(http, kind):
    if kind == "completions":
        path, base, samples = COMPLETIONS, _cmpl(**SAMPLED, logprobs=0), _completion_samples
    else:
        path, base, samples = CHAT, _chat(**SAMPLED, logprobs=True), _chat_samples
    best = post_ok(http, path, {**base, "n": 1, "best_of": 3})
    three = post_ok(http, path, {**base, "n": 3})
    assert len(best["choices"]) == 1 and best["choices"][0]["index"] == 0, best["choices"]
    assert sorted(c["index"] for c in three["choices"]) == [0, 1, 2]
    ((text, logprob),) = samples(best["choices"])
    candidates = samples(sorted(three["choices"], key=lambda c: c["index"]))
    assert text in [t for t, _ in candidates], (text, candidates)
    assert abs(logprob - max(lp for _, lp in candidates)) <= 1e-4, (logprob, candidates)
    # every sample's tokens are generated, so all count
    assert best["usage"]["completion_tokens"] == three["usage"]["completion_tokens"], (
        best["usage"],
        three["usage"],
    )
    assert best["usage"]["prompt_tokens"] == three["usage"]["prompt_tokens"]


def test_best_of_equal_to_n_changes_nothing(http):
    base = _cmpl(**SAMPLED)
    plain = post_ok(http, COMPLETIONS, {**base, "n": 2})
    same = post_ok(http, COMPLETIONS, {**base, "n": 2, "best_of": 2})
    assert [c["text"] for c in plain["choices"]] == [c["text"] for c in same["choices"]]


# ------------------------------------------------------------------------------------------------
# chat echo
# ------------------------------------------------------------------------------------------------

CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]


def _continue(**kw) -> dict:
    return _chat(
        messages=CONTINUED,
        add_generation_prompt=False,
        continue_final_message=True,
        max_tokens=5,
        **kw,
    )


def _content(body: dict) -> str:
    return body["choices"][0]["message"]["content"] or ""


def test_chat_echo_prepends_the_continued_message(http):
    plain = _content(post_ok(http, CHAT, _continue()))
    echoed = _content(post_ok(http, CHAT, _continue(echo=True)))
    assert echoed.startswith("Once upon"), echoed
    assert echoed == "Once upon" + plain, (echoed, plain)


def test_chat_echo_without_a_final_assistant_message_adds_nothing(http):
    messages = [{"role": "user", "content": "hi"}]
    plain = _content(post_ok(http, CHAT, _chat(messages=messages, max_tokens=5)))
    echoed = _content(post_ok(http, CHAT, _chat(messages=messages, max_tokens=5, echo=True)))
    assert echoed == plain


def test_chat_echo_streamed_equals_non_streamed(http):
    echoed = _content(post_ok(http, CHAT, _continue(echo=True)))
    events = parse_sse(http.post(CHAT, json=_continue(echo=True, stream=True)))
    streamed = "".join(
        c["delta"].get("content") or "" for ev in events for c in ev.get("choices", [])
    )
    assert streamed == echoed, (streamed, echoed)
