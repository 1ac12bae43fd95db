"""Structured outputs over HTTP (vLLM's dialect): `response_format` (`json_object`, `json_schema`),
the `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extensions and the newer
`structured_outputs` object, on chat and text completions, plain and streamed.

The model is random, so the tests check structure, never meaning: every sample that ends with
finish reason `stop` parses and validates (JSON schema, full regex match, one of the choices, the
grammar's language); samples cut by `max_tokens` end with `length`. Schemas bound every string,
array and number so that most samples can finish within the 256-token context.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from support.http_checks import MODEL, assert_error, assert_still_serving, parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "Answer in JSON:"
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
# share of the samples of a bounded constraint that must end on their own (finish reason `stop`)
MIN_STOP_SHARE = 0.8

# ------------------------------------------------------------------------------------------------
# schemas: every string, array and number bounded, no additional properties
# ------------------------------------------------------------------------------------------------

FLAT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "version": {"const": 2},
    },
    "required": ["id", "ok", "color", "version"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "age": {"type": "integer", "minimum": 1, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["user", "active"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "minItems": 1,
            "maxItems": 4,
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 9},
            "minItems": 2,
            "maxItems": 3,
        },
    },
    "required": ["tags", "scores"],
    "additionalProperties": False,
}
OPTIONAL = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 1, "maximum": 50},
        "b": {"type": "string", "maxLength": 10},
        "c": {"type": "boolean"},
    },
    "required": ["a"],
    "additionalProperties": False,
}
ANY_OF = {
    "type": "object",
    "properties": {
        "value": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": 9},
                {"type": "string", "pattern": "^[a-z]{1,5}$"},
                {"type": "boolean"},
            ]
        },
        "kind": {"enum": ["x", "y"]},
    },
    "required": ["value", "kind"],
    "additionalProperties": False,
}
LIST_OF_OBJECTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "k": {"enum": ["a", "b", "c"]},
            "v": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["k", "v"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
REFS = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 1, "maximum": 9},
                "y": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "start": {"$ref": "#/$defs/point"},
        "end": {"$ref": "#/$defs/point"},
        "label": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["start", "end", "label"],
    "additionalProperties": False,
}
# (name, schema, whether the compact text is exactly json.dumps(..., separators=(",", ":")):
#  true when no string can hold free text, so there is only one way to write each value)
SCHEMAS: list[tuple[str, dict[str, Any], bool]] = [
    ("flat", FLAT, True),
    ("nested", NESTED, True),
    ("arrays", ARRAYS, True),
    ("optional", OPTIONAL, False),
    ("any-of", ANY_OF, True),
    ("list-of-objects", LIST_OF_OBJECTS, True),
    ("refs", REFS, False),
]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}

REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "dark purple"]
YES_NO = 'start: "yes" | "no"'
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""


class Pet(BaseModel):
    """A small model for the official client's `parse`: every field bounded."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=20)
    kind: Literal["cat", "dog"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def body_for(path: str, **kw: Any) -> dict[str, Any]:
    """A request body for `path` with the test prompt (or messages)."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 120}
    if path == CHAT:
        base["messages"] = MESSAGES
    else:
        base["prompt"] = PROMPT
    return {**base, **kw}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def json_constraint(spelling: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The request fields asking for JSON following `schema`, in one of the accepted spellings."""
    if spelling == "response_format":
        return {"response_format": json_schema_format(schema)}
    if spelling == "guided_json":
        return {"guided_json": schema}
    if spelling == "guided_json_string":
        return {"guided_json": json.dumps(schema)}
    if spelling == "structured_outputs":
        return {"structured_outputs": {"json": schema}}
    if spelling == "structured_outputs_string":
        return {"structured_outputs": {"json": json.dumps(schema)}}
    raise ValueError(spelling)


SPELLINGS = [
    "response_format",
    "guided_json",
    "structured_outputs",
    "guided_json_string",
    "structured_outputs_string",
]


def post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:1000]}\nrequest: {json.dumps(body)[:600]}"
    return r.json()


def samples(path: str, resp: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice, in index order."""
    out = []
    for i, c in enumerate(sorted(resp["choices"], key=lambda c: c["index"])):
        assert c["index"] == i, resp["choices"]
        text = c["text"] if path == COMPLETIONS else c["message"]["content"]
        assert isinstance(text, str), c
        assert c["finish_reason"] in ("stop", "length"), c
        out.append((text, c["finish_reason"]))
    return out


def post_all(http: httpx.Client, jobs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sends the requests concurrently (so the server batches them); answers in order."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: post_ok(http, *job), jobs))


def whitespace_outside_strings(text: str) -> bool:
    """Whether JSON text (or a prefix of it) has whitespace outside its string literals."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in " \t\r\n":
            return True
    return False


def check_json_samples(
    got: list[tuple[str, str]], schema: dict[str, Any], *, exact_compact: bool, what: str
) -> int:
    """Every `stop` sample is compact JSON valid against `schema`; returns how many stopped."""
    stopped = 0
    for text, finish in got:
        assert text[:1] in ("{", "["), f"{what}: does not start as JSON: {text!r}"
        assert not whitespace_outside_strings(text), f"{what}: whitespace outside strings: {text!r}"
        if finish != "stop":
            continue
        stopped += 1
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            pytest.fail(f"{what}: finished with `stop` but is not JSON ({e}): {text!r}")
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{what}: does not follow the schema ({e.message}): {text!r}")
        if exact_compact:
            compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            assert text == compact, f"{what}: not compact: {text!r} (compact: {compact!r})"
    return stopped


def assert_mostly_stopped(stopped: int, total: int, what: str) -> None:
    assert total > 0
    assert stopped >= MIN_STOP_SHARE * total, (
        f"{what}: only {stopped} of {total} samples finished with `stop` (the rest hit max_tokens)"
    )


def is_arithmetic(text: str) -> bool:
    """Whether `text` is an expression of the ARITHMETIC grammar (no spaces, no unary signs)."""
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return False
    if not all(re.fullmatch(r"[1-9][0-9]?", number) for number in re.findall(r"[0-9]+", text)):
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


# ------------------------------------------------------------------------------------------------
# JSON schema: 100+ seeded samples over several schemas, spellings and both endpoints
# ------------------------------------------------------------------------------------------------


def test_json_schema_samples_validate(http: httpx.Client) -> None:
    jobs: list[tuple[str, dict[str, Any]]] = []
    labels: list[tuple[str, dict[str, Any], bool, str]] = []
    i = 0
    for name, schema, exact in SCHEMAS:
        for seed in (101, 202):
            path = COMPLETIONS if i % 2 == 0 else CHAT
            spelling = SPELLINGS[i % len(SPELLINGS)]
            body = body_for(path, n=8, temperature=1.0, seed=seed, **json_constraint(spelling, schema))
            jobs.append((path, body))
            labels.append((name, schema, exact, f"{name} via {spelling} on {path} (seed {seed})"))
            i += 1
    stopped = total = 0
    for (path, _), resp, (name, schema, exact, what) in zip(jobs, post_all(http, jobs), labels):
        got = samples(path, resp)
        assert len(got) == 8, what
        stopped += check_json_samples(got, schema, exact_compact=exact, what=what)
        total += len(got)
    assert total >= 100
    assert_mostly_stopped(stopped, total, "JSON schema samples")


def test_json_is_compact_by_default(http: httpx.Client) -> None:
    compact = {"structured_outputs": {"json": FLAT, "disable_any_whitespace": True}}
    flexible = {"structured_outputs": {"json": FLAT, "disable_any_whitespace": False}}
    jobs = [
        (CHAT, body_for(CHAT, n=8, temperature=1.0, seed=7, response_format=json_schema_format(FLAT))),
        (COMPLETIONS, body_for(COMPLETIONS, n=8, temperature=1.0, seed=7, **compact)),
        (COMPLETIONS, body_for(COMPLETIONS, n=8, temperature=1.0, seed=8, max_tokens=80, **flexible)),
    ]
    default, explicit, relaxed = post_all(http, jobs)
    for what, got in (
        ("default", samples(CHAT, default)),
        ("disable_any_whitespace", samples(COMPLETIONS, explicit)),
    ):
        assert_mostly_stopped(check_json_samples(got, FLAT, exact_compact=True, what=what), len(got), what)
    # with whitespace allowed the output may be spread out, but what ends is still valid
    for text, finish in samples(COMPLETIONS, relaxed):
        if finish == "stop":
            jsonschema.validate(json.loads(text), FLAT)


@pytest.mark.parametrize(
    "path,fields",
    [
        (CHAT, {"response_format": {"type": "json_object"}}),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}),
        (COMPLETIONS, {"structured_outputs": {"json_object": True}}),
    ],
    ids=["chat-response_format", "cmpl-response_format", "cmpl-structured_outputs"],
)
def test_json_object_mode_writes_an_object(http: httpx.Client, path: str, fields: dict[str, Any]) -> None:
    # any object: strings are unbounded, so samples may well be cut by max_tokens
    resp = post_ok(http, path, body_for(path, n=8, temperature=1.0, seed=5, max_tokens=48, **fields))
    for text, finish in samples(path, resp):
        assert text.startswith("{"), f"not a JSON object: {text!r}"
        assert not whitespace_outside_strings(text), f"whitespace outside strings: {text!r}"
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text


def test_response_format_text_leaves_the_output_alone(http: httpx.Client) -> None:
    for path in (CHAT, COMPLETIONS):
        plain = body_for(path, max_tokens=12, temperature=0, ignore_eos=True)
        a = samples(path, post_ok(http, path, plain))
        b = samples(path, post_ok(http, path, {**plain, "response_format": {"type": "text"}}))
        assert a == b, path


# ------------------------------------------------------------------------------------------------
# regex, choice, grammar
# ------------------------------------------------------------------------------------------------

OTHER_KINDS: list[tuple[str, str, dict[str, Any], Callable[[str], bool]]] = [
    # (id, path, fields, check of a finished sample)
    ("guided_regex", COMPLETIONS, {"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ("structured_outputs-regex", CHAT, {"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    ("guided_choice", COMPLETIONS, {"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ("structured_outputs-choice", CHAT, {"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ("guided_grammar-yes-no", COMPLETIONS, {"guided_grammar": YES_NO}, lambda t: t in ("yes", "no")),
    ("guided_grammar-arithmetic", COMPLETIONS, {"guided_grammar": ARITHMETIC}, is_arithmetic),
    ("structured_outputs-grammar", CHAT, {"structured_outputs": {"grammar": ARITHMETIC}}, is_arithmetic),
]


@pytest.mark.parametrize(
    "path,fields,check", [c[1:] for c in OTHER_KINDS], ids=[c[0] for c in OTHER_KINDS]
)
def test_regex_choice_and_grammar_samples(
    http: httpx.Client, path: str, fields: dict[str, Any], check: Callable[[str], bool]
) -> None:
    jobs = [(path, body_for(path, n=8, temperature=1.0, seed=seed, max_tokens=100, **fields)) for seed in (3, 4)]
    got = [s for resp in post_all(http, jobs) for s in samples(path, resp)]
    stopped = [text for text, finish in got if finish == "stop"]
    for text in stopped:
        assert check(text), f"{text!r} is outside the constraint {fields}"
    assert_mostly_stopped(len(stopped), len(got), str(fields))


def test_every_choice_can_come_out(http: httpx.Client) -> None:
    resp = post_ok(
        http, COMPLETIONS, body_for(COMPLETIONS, n=16, temperature=1.0, seed=9, guided_choice=["left", "right"])
    )
    texts = [t for t, finish in samples(COMPLETIONS, resp) if finish == "stop"]
    assert set(texts) == {"left", "right"}, texts


# ------------------------------------------------------------------------------------------------
# bad constraints: 400 in OpenAI's error shape, and the server keeps serving
# ------------------------------------------------------------------------------------------------

BAD_CONSTRAINTS: list[tuple[str, dict[str, Any]]] = [
    ("guided_json-bad-type", {"guided_json": BAD_SCHEMA}),
    ("guided_json-unresolved-ref", {"guided_json": {"$ref": "#/$defs/missing"}}),
    ("guided_json-not-json", {"guided_json": "{not json"}),
    ("guided_json-number", {"guided_json": 5}),
    ("response_format-bad-schema", {"response_format": json_schema_format(BAD_SCHEMA)}),
    ("response_format-without-json_schema", {"response_format": {"type": "json_schema"}}),
    ("response_format-unknown-type", {"response_format": {"type": "yaml"}}),
    ("structured_outputs-bad-schema", {"structured_outputs": {"json": BAD_SCHEMA}}),
    ("guided_regex-unclosed", {"guided_regex": "(unclosed"}),
    ("structured_outputs-regex-unclosed", {"structured_outputs": {"regex": "[a-"}}),
    ("guided_choice-empty", {"guided_choice": []}),
    ("guided_choice-string", {"guided_choice": "a"}),
    ("structured_outputs-choice-empty", {"structured_outputs": {"choice": []}}),
    ("guided_grammar-undefined-rule", {"guided_grammar": "start: missing_rule"}),
    ("guided_grammar-unclosed-group", {"guided_grammar": 'start: ("a"'}),
    ("structured_outputs-grammar-unclosed-string", {"structured_outputs": {"grammar": 'start: "a'}}),
    ("structured_outputs-no-kind", {"structured_outputs": {}}),
    ("two-guided-kinds", {"guided_json": {"type": "object"}, "guided_regex": "a+"}),
    ("response_format-and-guided", {"response_format": {"type": "json_object"}, "guided_choice": ["a", "b"]}),
    ("two-structured_outputs-kinds", {"structured_outputs": {"json": FLAT, "choice": ["a"]}}),
    ("structured_outputs-and-guided", {"structured_outputs": {"regex": "a+"}, "guided_regex": "b+"}),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "cmpl"])
@pytest.mark.parametrize("fields", [c[1] for c in BAD_CONSTRAINTS], ids=[c[0] for c in BAD_CONSTRAINTS])
def test_bad_constraints_are_400(http: httpx.Client, path: str, fields: dict[str, Any]) -> None:
    err = assert_error(http.post(path, json=body_for(path, max_tokens=4, **fields)), 400)
    assert err["type"] in ("BadRequestError", "invalid_request_error"), err
    assert err["code"] in (400, "400"), err
    assert_still_serving(http)


def test_a_bad_constraint_is_refused_before_streaming(http: httpx.Client) -> None:
    for path in (CHAT, COMPLETIONS):
        r = http.post(path, json=body_for(path, max_tokens=4, stream=True, guided_regex="(unclosed"))
        assert_error(r, 400)
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------------
# streaming, length, stop strings
# ------------------------------------------------------------------------------------------------


def stream_samples(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(concatenated text, finish_reason) of each choice of a streamed request."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        r.read()
        events = parse_sse(r)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ev in events:
        for c in ev["choices"]:
            i = c["index"]
            piece = c["text"] if path == COMPLETIONS else (c["delta"].get("content") or "")
            texts[i] = texts.get(i, "") + piece
            if c.get("finish_reason") is not None:
                assert i not in finish, f"two finish reasons for choice {i}"
                finish[i] = c["finish_reason"]
    assert sorted(texts) == list(range(len(texts))), sorted(texts)
    assert sorted(finish) == sorted(texts), f"choices without a finish reason: {finish}"
    return [(texts[i], finish[i]) for i in range(len(texts))]


STREAM_CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("cmpl-guided_json-n2", COMPLETIONS, {"guided_json": NESTED}, 2),
    ("chat-response_format", CHAT, {"response_format": json_schema_format(ARRAYS)}, 1),
    ("cmpl-guided_regex-n2", COMPLETIONS, {"guided_regex": REGEX}, 2),
    ("chat-structured_outputs-grammar", CHAT, {"structured_outputs": {"grammar": ARITHMETIC}}, 1),
]


@pytest.mark.parametrize(
    "path,fields,n", [c[1:] for c in STREAM_CASES], ids=[c[0] for c in STREAM_CASES]
)
def test_streamed_equals_non_streamed(http: httpx.Client, path: str, fields: dict[str, Any], n: int) -> None:
    body = body_for(path, n=n, temperature=0.8, seed=1234, max_tokens=100, **fields)
    whole = samples(path, post_ok(http, path, body))
    assert stream_samples(http, path, body) == whole


def test_max_tokens_cuts_the_structure_with_finish_reason_length(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 50}
        },
        "required": ["items"],
        "additionalProperties": False,
    }
    body = body_for(COMPLETIONS, max_tokens=8, temperature=1.0, seed=2, guided_json=schema)
    resp = post_ok(http, COMPLETIONS, body)
    [(text, finish)] = samples(COMPLETIONS, resp)
    assert finish == "length", text
    assert resp["usage"]["completion_tokens"] == 8
    opening = '{"items":['
    assert opening.startswith(text) or re.fullmatch(r'\{"items":\[[1-9](,[1-9])*,?', text), text
    assert stream_samples(http, COMPLETIONS, body) == [(text, "length")]


STOP_CASES: list[tuple[str, str, dict[str, Any], str, str, str]] = [
    # (id, path, fields, the whole constrained text, a stop string, the text cut at the stop string)
    ("grammar", COMPLETIONS, {"guided_grammar": 'start: "alpha" "," "beta" "," "gamma"'}, "alpha,beta,gamma", "beta", "alpha,"),
    (
        "json",
        CHAT,
        {
            "response_format": json_schema_format(
                {
                    "type": "object",
                    "properties": {"answer": {"enum": ["alpha beta"]}},
                    "required": ["answer"],
                    "additionalProperties": False,
                }
            )
        },
        '{"answer":"alpha beta"}',
        "beta",
        '{"answer":"alpha ',
    ),
]


@pytest.mark.parametrize(
    "path,fields,whole,stop,cut", [c[1:] for c in STOP_CASES], ids=[c[0] for c in STOP_CASES]
)
def test_stop_strings_end_constrained_output(
    http: httpx.Client, path: str, fields: dict[str, Any], whole: str, stop: str, cut: str
) -> None:
    body = body_for(path, max_tokens=60, temperature=1.0, seed=11, **fields)
    assert samples(path, post_ok(http, path, body)) == [(whole, "stop")]
    assert samples(path, post_ok(http, path, {**body, "stop": [stop]})) == [(cut, "stop")]
    assert stream_samples(http, path, {**body, "stop": [stop]}) == [(cut, "stop")]


# ------------------------------------------------------------------------------------------------
# constrained and unconstrained requests in one batch
# ------------------------------------------------------------------------------------------------


def test_unconstrained_requests_are_unaffected_by_constrained_ones(http: httpx.Client) -> None:
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    plain = [
        (COMPLETIONS, {"model": MODEL, "prompt": "Once upon a time", **greedy}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], **greedy}),
        (COMPLETIONS, body_for(COMPLETIONS, temperature=0, guided_json=NESTED)),
    ]
    sampled = [
        (COMPLETIONS, body_for(COMPLETIONS, n=4, temperature=1.0, seed=31, guided_json=ARRAYS)),
        (CHAT, body_for(CHAT, n=4, temperature=1.0, seed=32, response_format=json_schema_format(REFS))),
        (COMPLETIONS, body_for(COMPLETIONS, n=4, temperature=1.0, seed=33, guided_regex=REGEX)),
        (COMPLETIONS, body_for(COMPLETIONS, n=4, temperature=1.0, seed=34, guided_grammar=ARITHMETIC)),
        (CHAT, body_for(CHAT, n=4, temperature=1.0, seed=35, guided_choice=CHOICES)),
    ]
    alone = [samples(path, post_ok(http, path, body)) for path, body in plain]
    # each plain request twice, between and after the constrained ones
    jobs = [*plain, *sampled, *plain]
    mixed = post_all(http, jobs)
    for k, ((path, _), resp) in enumerate(zip(jobs, mixed)):
        if k < len(plain):
            assert samples(path, resp) == alone[k], f"request {k} changed when batched with constrained ones"
        elif k >= len(plain) + len(sampled):
            assert samples(path, resp) == alone[k - len(plain) - len(sampled)], f"request {k} changed"
    # the constrained ones held in the mixed batch too
    arrays, refs, regex, arithmetic, choice = mixed[len(plain) : len(plain) + len(sampled)]
    check_json_samples(samples(COMPLETIONS, arrays), ARRAYS, exact_compact=True, what="arrays")
    check_json_samples(samples(CHAT, refs), REFS, exact_compact=False, what="refs")
    for text, finish in samples(COMPLETIONS, regex):
        assert finish != "stop" or re.fullmatch(REGEX, text), text
    for text, finish in samples(COMPLETIONS, arithmetic):
        assert finish != "stop" or is_arithmetic(text), text
    for text, finish in samples(CHAT, choice):
        assert finish != "stop" or text in CHOICES, text


# ------------------------------------------------------------------------------------------------
# the official client
# ------------------------------------------------------------------------------------------------


def test_openai_client_parse_returns_the_model(client: OpenAI) -> None:
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed, temperature in ((3, 1.0), (0, 0.0)):
        completion = parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_tokens=120,
            temperature=temperature,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message
        assert Pet.model_validate_json(choice.message.content or "") == choice.message.parsed
