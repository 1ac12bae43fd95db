"""Tool calling over HTTP (chat only, vLLM's dialect): `tools` with `tool_choice` `none`, `auto`,
`required` or a named function, `parallel_tool_calls`, streamed `delta.tool_calls`, a tool
round trip, and the clients users bring (the official `openai` client, LangChain).

The fixture model's own chat template spells out each tool as JSON under a long preamble, more
than its 256-token context holds, so most of these tests use two instances that serve a compact
tool-aware template (conftest.py's TOOLS_CHAT_TEMPLATE, hermes-style `<tool_call>` blocks):
`tools_server` with `--enable-auto-tool-choice --tool-call-parser hermes`, and
`plain_tools_server` without those flags. The model is random: tests check the shape of the calls
and that their arguments validate against the tool's parameters, never what they say.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from support.http_checks import MODEL, assert_error, assert_still_serving, parse_sse
from support.rserve_process import RserveProcess

CHAT = "/v1/chat/completions"

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 10}},
    "required": ["tz"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current time in a time zone.", "parameters": TIME_PARAMS},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
PARAMS_OF = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
BAD_PARAMS = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


class Pet(BaseModel):
    """A small structured answer: every field bounded."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=20)
    kind: Literal["cat", "dog"]


class Weather(BaseModel):
    """Arguments of get_weather as a pydantic model."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


# ------------------------------------------------------------------------------------------------
# clients of the two tool-calling instances (`tools_server`, `plain_tools_server`: conftest.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thttp(tools_server: RserveProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tools_server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def plain_http(plain_tools_server: RserveProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plain_tools_server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def tclient(tools_server: RserveProcess) -> Iterator[OpenAI]:
    c = OpenAI(base_url=f"{tools_server.url}/v1", api_key="x", max_retries=0, timeout=120.0)
    yield c
    c.close()


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, **kw}


def post_chat(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:1000]}"
    return r.json()


def post_chats(http: httpx.Client, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sends the requests concurrently (so the server batches them); answers in order."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda b: post_chat(http, b), bodies))


def check_call(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One entry of `message.tool_calls`: its shape, a known function and arguments (a JSON
    string) valid against that function's parameters; returns (name, parsed arguments)."""
    assert isinstance(call.get("id"), str) and call["id"], call
    assert call.get("type") == "function", call
    fn = call["function"]
    assert fn["name"] in PARAMS_OF, f"unknown function {fn['name']!r}"
    assert isinstance(fn["arguments"], str), call
    args = json.loads(fn["arguments"])
    jsonschema.validate(args, PARAMS_OF[fn["name"]])
    return fn["name"], args


def calls_of(resp: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The checked tool calls of the only choice (ids unique)."""
    msg = resp["choices"][0]["message"]
    assert msg["role"] == "assistant", msg
    calls = msg.get("tool_calls") or []
    assert len({c["id"] for c in calls}) == len(calls), f"tool call ids repeat: {calls}"
    return [check_call(c) for c in calls]


def assert_no_text(resp: dict[str, Any]) -> None:
    content = resp["choices"][0]["message"].get("content")
    assert content in (None, ""), f"a tool call answer has content {content!r}"


def stream_calls(
    http: httpx.Client, body: dict[str, Any]
) -> tuple[list[tuple[str, dict[str, Any]]], str, str]:
    """Streams `body`; checks how `delta.tool_calls` arrive (index, then id, type and name with
    the first piece of a call, then argument pieces); returns (calls, content, finish_reason)."""
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        r.read()
        events = parse_sse(r)
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish: str | None = None
    with_choices = [ev for ev in events if ev["choices"]]
    assert with_choices and with_choices[0]["choices"][0]["delta"].get("role") == "assistant", with_choices[:1]
    for k, ev in enumerate(with_choices):
        for c in ev["choices"]:
            assert c["index"] == 0, c
            delta = c.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                i = tc["index"]
                fn = tc.get("function") or {}
                if i not in calls:
                    assert i == len(calls), f"call {i} starts before call {len(calls)}"
                    assert isinstance(tc.get("id"), str) and tc["id"], f"first piece of call {i} lacks an id: {tc}"
                    assert tc.get("type") == "function", tc
                    assert isinstance(fn.get("name"), str) and fn["name"], f"first piece lacks the name: {tc}"
                    calls[i] = {"id": tc["id"], "name": fn["name"], "arguments": ""}
                else:
                    assert fn.get("name") in (None, calls[i]["name"]), f"call {i} renamed: {tc}"
                    assert tc.get("id") in (None, calls[i]["id"]), f"call {i} got another id: {tc}"
                calls[i]["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason") is not None:
                assert finish is None, "two finish reasons"
                assert k == len(with_choices) - 1, "the finish reason is not on the last chunk"
                finish = c["finish_reason"]
    assert finish is not None, "no finish reason"
    checked = [
        check_call({"id": v["id"], "type": "function", "function": {"name": v["name"], "arguments": v["arguments"]}})
        for _, v in sorted(calls.items())
    ]
    return checked, content, finish


# ------------------------------------------------------------------------------------------------
# tool_choice
# ------------------------------------------------------------------------------------------------


def test_tools_are_rendered_into_the_prompt(thttp: httpx.Client) -> None:
    base = chat_body(max_tokens=1, temperature=0, tool_choice="none")
    without = post_chat(thttp, {k: v for k, v in base.items() if k not in ("tools", "tool_choice")})
    with_tools = post_chat(thttp, base)
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


def test_the_models_own_template_renders_every_tool(http: httpx.Client) -> None:
    # the fixture's template spells out each tool's JSON under a long preamble: over 256 tokens
    r = http.post(CHAT, json=chat_body(max_tokens=1, tool_choice="none"))
    assert_error(r, 400, "maximum context length is 256 tokens")
    assert_still_serving(http)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_calls_that_function(thttp: httpx.Client, name: str) -> None:
    bodies = [chat_body(tool_choice=named(name), seed=seed) for seed in range(4)]
    for resp in post_chats(thttp, bodies):
        choice = resp["choices"][0]
        assert choice["finish_reason"] in ("stop", "tool_calls"), choice
        calls = calls_of(resp)
        assert len(calls) == 1 and calls[0][0] == name, calls
        assert_no_text(resp)


def test_required_tool_choice_calls_known_functions(thttp: httpx.Client) -> None:
    # several calls may come (parallel calls are allowed): some samples may run out of tokens
    bodies = [chat_body(tool_choice="required", seed=seed, max_tokens=200) for seed in range(6)]
    finished = 0
    for resp in post_chats(thttp, bodies):
        finish = resp["choices"][0]["finish_reason"]
        assert finish in ("tool_calls", "length"), resp["choices"][0]
        if finish == "tool_calls":
            finished += 1
            assert len(calls_of(resp)) >= 1, resp
            assert_no_text(resp)
    assert finished >= 4, f"only {finished} of 6 required-tool answers finished"


def test_required_without_parallel_calls_makes_exactly_one(thttp: httpx.Client) -> None:
    bodies = [chat_body(tool_choice="required", parallel_tool_calls=False, seed=seed) for seed in range(4)]
    names = set()
    for resp in post_chats(thttp, bodies):
        assert resp["choices"][0]["finish_reason"] == "tool_calls", resp["choices"][0]
        calls = calls_of(resp)
        assert len(calls) == 1, calls
        names.add(calls[0][0])
    assert names <= set(PARAMS_OF)


def test_tool_choice_none_answers_in_text(thttp: httpx.Client) -> None:
    resp = post_chat(thttp, chat_body(tool_choice="none", max_tokens=16, seed=1))
    msg = resp["choices"][0]["message"]
    assert not msg.get("tool_calls"), msg
    assert isinstance(msg["content"], str), msg
    assert resp["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["auto", None], ids=["auto", "omitted"])
def test_auto_tool_choice_answers(thttp: httpx.Client, tool_choice: str | None) -> None:
    body = chat_body(max_tokens=16, seed=2)
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    resp = post_chat(thttp, body)
    choice = resp["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    if msg.get("tool_calls"):
        assert isinstance(msg["tool_calls"], list)
        for call in msg["tool_calls"]:
            assert call["type"] == "function" and isinstance(call["function"]["arguments"], str), call
    else:
        assert isinstance(msg["content"], str), msg


@pytest.mark.parametrize("instance", ["plain_tools_server", "edge_server"])
def test_auto_tool_choice_needs_the_flag(request: pytest.FixtureRequest, instance: str) -> None:
    # (refused before the prompt is rendered: on edge_server, with the fixture's own template,
    # the tools would not even fit the context)
    srv = request.getfixturevalue(instance)
    with httpx.Client(base_url=srv.url, timeout=120.0) as c:
        r = c.post(CHAT, json=chat_body(tool_choice="auto", max_tokens=4))
        assert_error(r, 400, "--enable-auto-tool-choice")
        assert_still_serving(c)


def test_named_and_required_work_without_the_auto_flag(plain_http: httpx.Client) -> None:
    named_resp, required_resp = post_chats(
        plain_http,
        [
            chat_body(tool_choice=named("get_weather"), seed=5),
            chat_body(tool_choice="required", parallel_tool_calls=False, seed=5),
        ],
    )
    assert [name for name, _ in calls_of(named_resp)] == ["get_weather"]
    assert required_resp["choices"][0]["finish_reason"] == "tool_calls"
    assert len(calls_of(required_resp)) == 1


BAD_TOOL_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("named-unknown-function", chat_body(tool_choice=named("get_stock"))),
    ("named-without-tools", {**chat_body(tool_choice=named("get_weather")), "tools": None}),
    ("required-without-tools", {**chat_body(tool_choice="required"), "tools": None}),
    ("unknown-tool_choice", chat_body(tool_choice="sometimes")),
    (
        "named-bad-parameters",
        chat_body(
            tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_PARAMS}}],
            tool_choice=named("f"),
        ),
    ),
    (
        "required-bad-parameters",
        chat_body(
            tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "f", "parameters": BAD_PARAMS}}],
            tool_choice="required",
        ),
    ),
    ("function-without-name", chat_body(tools=[{"type": "function", "function": {"parameters": TIME_PARAMS}}])),
]


@pytest.mark.parametrize("body", [c[1] for c in BAD_TOOL_REQUESTS], ids=[c[0] for c in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_are_400(thttp: httpx.Client, body: dict[str, Any]) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    err = assert_error(thttp.post(CHAT, json={**body, "max_tokens": 4}), 400)
    assert err["type"] in ("BadRequestError", "invalid_request_error"), err
    assert_still_serving(thttp)


# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------


def test_streamed_named_tool_call_matches_non_streamed(thttp: httpx.Client) -> None:
    body = chat_body(tool_choice=named("get_weather"), temperature=0.8, seed=21)
    whole = post_chat(thttp, body)
    calls, content, finish = stream_calls(thttp, body)
    assert content == ""
    assert [name for name, _ in calls] == ["get_weather"]
    assert calls == calls_of(whole)
    assert finish == whole["choices"][0]["finish_reason"]


def test_streamed_required_tool_calls_match_non_streamed(thttp: httpx.Client) -> None:
    bodies = [chat_body(tool_choice="required", temperature=0.8, seed=seed, max_tokens=200) for seed in range(40, 46)]
    answers = post_chats(thttp, bodies)
    done = [(b, a) for b, a in zip(bodies, answers) if a["choices"][0]["finish_reason"] == "tool_calls"]
    assert done, "no required-tool answer finished"
    # prefer an answer with several calls, to see more than index 0 streamed
    body, whole = max(done, key=lambda ba: len(ba[1]["choices"][0]["message"]["tool_calls"]))
    calls, content, finish = stream_calls(thttp, body)
    assert content == ""
    assert calls == calls_of(whole)
    assert finish == "tool_calls"


# ------------------------------------------------------------------------------------------------
# a tool round trip
# ------------------------------------------------------------------------------------------------


def test_a_tool_round_trip_is_accepted(thttp: httpx.Client) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    for tool_choice in ("none", "auto"):
        resp = post_chat(thttp, chat_body(messages=messages, tool_choice=tool_choice, max_tokens=8, seed=3))
        assert resp["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


# ------------------------------------------------------------------------------------------------
# the official client
# ------------------------------------------------------------------------------------------------


def test_openai_client_named_tool_call_and_round_trip(tclient: OpenAI) -> None:
    resp = tclient.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named("get_weather"),
        max_tokens=120,
        temperature=1.0,
        seed=8,
    )
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason in ("stop", "tool_calls")
    assert msg.tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    # send the answer back with the tool's result, as an agent loop does
    follow_up = tclient.chat.completions.create(
        model=MODEL,
        messages=[
            *MESSAGES,
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_client_parses_strict_function_tools(tclient: OpenAI) -> None:
    parse = getattr(tclient.chat.completions, "parse", None) or tclient.beta.chat.completions.parse
    completion = parse(
        model=MODEL,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice=named("get_weather"),
        max_tokens=120,
        temperature=1.0,
        seed=9,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.parsed_arguments, Weather), calls[0]


# ------------------------------------------------------------------------------------------------
# LangChain
# ------------------------------------------------------------------------------------------------


def langchain_chat(tools_server: RserveProcess) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=f"{tools_server.url}/v1",
        api_key="x",
        model=MODEL,
        max_tokens=100,
        temperature=0,
        max_retries=0,
        timeout=120,
    )


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"], ids=["default", "json_schema", "function_calling"])
def test_langchain_structured_output(tools_server: RserveProcess, method: str | None) -> None:
    llm = langchain_chat(tools_server)
    structured = llm.with_structured_output(Pet) if method is None else llm.with_structured_output(Pet, method=method)
    pet = structured.invoke("hi")
    assert isinstance(pet, Pet), pet


def test_langchain_bind_tools_with_a_named_choice(tools_server: RserveProcess) -> None:
    llm = langchain_chat(tools_server)
    message = llm.bind_tools([WEATHER_TOOL, TIME_TOOL], tool_choice="get_weather").invoke("weather?")
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == "get_weather", call
    assert call["id"], call
    jsonschema.validate(call["args"], WEATHER_PARAMS)
