"""POST /v1/responses (the OpenAI Responses API) through the official client: the same generation
as a chat completion of the equivalent messages, as a response object or a stream of typed events."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from support.http_checks import MODEL, assert_error

STORY = "Tell me a story"
MAX_OUTPUT = 8


def chat_reply(client: OpenAI, messages: list[dict], max_tokens: int = MAX_OUTPUT) -> tuple[str, str]:
    """Greedy chat completion: (content, finish_reason)."""
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def respond(client: OpenAI, **kw):
    args = {"input": STORY, "max_output_tokens": MAX_OUTPUT, "temperature": 0, **kw}
    return client.responses.create(model=MODEL, **args)


def output_message_text(resp) -> str:
    """The text of the single assistant message of a response, checking its shape."""
    assert len(resp.output) == 1, resp.output
    item = resp.output[0]
    assert item.type == "message", item
    assert item.role == "assistant", item
    assert len(item.content) == 1, item.content
    part = item.content[0]
    assert part.type == "output_text", part
    assert isinstance(part.text, str)
    return part.text


def test_response_matches_chat(client, http):
    resp = respond(client)
    assert resp.id.startswith("resp"), resp.id
    assert resp.object == "response"
    assert resp.model == MODEL
    assert resp.status in ("completed", "incomplete"), resp.status
    text = output_message_text(resp)
    assert resp.output_text == text

    messages = [{"role": "user", "content": STORY}]
    expected, finish = chat_reply(client, messages)
    assert text == expected

    r = http.post(
        "/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True}
    )
    assert r.status_code == 200, r.text
    assert resp.usage is not None
    assert resp.usage.input_tokens == r.json()["count"], resp.usage
    assert 0 <= resp.usage.output_tokens <= MAX_OUTPUT, resp.usage
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens

    # finished by the token limit: incomplete, as OpenAI reports it
    assert resp.status == ("incomplete" if finish == "length" else "completed"), (resp.status, finish)
    if resp.status == "incomplete":
        assert resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens", resp.incomplete_details
        assert resp.usage.output_tokens == MAX_OUTPUT


def test_instructions_are_a_system_message(client):
    resp = respond(client, instructions="Be brief.")
    expected, _ = chat_reply(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": STORY}]
    )
    assert resp.output_text == expected


def test_input_forms_are_equivalent(client):
    texts = [
        respond(client, input="hi").output_text,
        respond(client, input=[{"role": "user", "content": "hi"}]).output_text,
        respond(
            client,
            input=[
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            ],
        ).output_text,
    ]
    assert texts[0] == texts[1] == texts[2], texts
    expected, _ = chat_reply(client, [{"role": "user", "content": "hi"}])
    assert texts[0] == expected


def test_multi_turn_input_matches_chat(client):
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "Tell me more."},
    ]
    resp = respond(client, input=turns)
    expected, _ = chat_reply(client, turns)
    assert resp.output_text == expected


def test_stream_events(client):
    expected = respond(client).output_text
    events = list(respond(client, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created", types
    assert types[1] == "response.in_progress", types
    assert types[-1] in ("response.completed", "response.incomplete"), types

    seq = [e.sequence_number for e in events]
    assert seq[0] == 0, seq
    assert all(a < b for a, b in zip(seq, seq[1:])), seq

    for t in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert types.count(t) == 1, (t, types)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    if expected:
        assert deltas, types
    order = [
        types.index("response.output_item.added"),
        types.index("response.content_part.added"),
        *(i for i, t in enumerate(types) if t == "response.output_text.delta"),
        types.index("response.output_text.done"),
        types.index("response.content_part.done"),
        types.index("response.output_item.done"),
        len(types) - 1,
    ]
    assert order == sorted(order) and order[0] > 1, types

    text = "".join(e.delta for e in deltas)
    assert text == expected, (text, expected)
    done = events[types.index("response.output_text.done")]
    assert done.text == text
    final = events[-1].response
    assert final.output_text == text
    assert final.status == events[-1].type.removeprefix("response."), (final.status, types[-1])
    assert final.usage is not None and final.usage.output_tokens <= MAX_OUTPUT
    assert events[0].response.status in ("in_progress", "queued"), events[0].response.status


@pytest.mark.parametrize(
    "kw",
    [
        {"previous_response_id": "resp_x"},
        {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"max_output_tokens": 0},
        {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
    ],
    ids=["previous_response_id", "tools", "max_output_tokens-0", "function_call_output-input"],
)
def test_unsupported_requests_are_400(client, http, kw):
    with pytest.raises(openai.BadRequestError):
        respond(client, **kw)
    body = {"model": MODEL, "input": STORY, "max_output_tokens": MAX_OUTPUT, **kw}
    assert_error(http.post("/v1/responses", json=body), 400)


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=STORY, max_output_tokens=2)
    r = http.post("/v1/responses", json={"model": "nope", "input": STORY})
    assert_error(r, 404)


def test_stream_of_a_bad_request_is_a_plain_400(http):
    body = {"model": MODEL, "input": STORY, "max_output_tokens": 0, "stream": True}
    r: httpx.Response = http.post("/v1/responses", json=body)
    assert_error(r, 400)
