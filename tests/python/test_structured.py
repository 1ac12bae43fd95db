"""Structured outputs in the in-process Python API (vLLM's offline shape):
`SamplingParams(structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=...,
grammar=..., json_object=...))`, the legacy `guided_decoding=` / `GuidedDecodingParams` spelling,
and `LLM.chat(..., tools=[...])`.

The model is the tiny random-weight qwen2 fixture: its text is nonsense, so the tests check that
every sample that ends with finish reason `stop` follows its constraint; schemas bound every
string, array and number so that most samples end within max_tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Literal

import pytest

try:
    import rserve._core  # noqa: F401
except ImportError as e:
    pytest.skip(
        f"rserve._core (the native module) cannot be imported ({type(e).__name__}: {e}); "
        "build it with `maturin develop --release` or `pip install .`",
        allow_module_level=True,
    )

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

import rserve
from rserve import LLM, RequestOutput, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN2 = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2"
MAX_MODEL_LEN = 256
PROMPT = "Answer in JSON:"
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MIN_STOP_SHARE = 0.8

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "admin": {"type": "boolean"},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "tags", "user"],
    "additionalProperties": False,
}
OTHER_SCHEMA = {
    "type": "array",
    "items": {
        "anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 99},
            {"type": "string", "maxLength": 6},
        ]
    },
    "minItems": 1,
    "maxItems": 4,
}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "dark purple"]
GRAMMAR = r"""
start: expr
expr: NUMBER (("+" | "-") NUMBER)*
NUMBER: /[1-9][0-9]?/
"""

# ChatML with a one-line tool list (the fixture's own template spells out every tool as JSON,
# more than the 256-token context holds)
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone.",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]},
        },
    },
]


class Pet(BaseModel):
    """A small structured answer: every field bounded."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=20)
    kind: Literal["cat", "dog"]


def so(**kw: Any) -> Any:
    """`rserve.StructuredOutputsParams(**kw)`."""
    return rserve.StructuredOutputsParams(**kw)


def sampled(constraint: Any, *, n: int = 8, seed: int = 1, max_tokens: int = 100, **kw: Any) -> SamplingParams:
    """Seeded sampling at temperature 1 under `constraint` (a StructuredOutputsParams)."""
    return SamplingParams(
        structured_outputs=constraint, n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, **kw
    )


def finished_texts(out: RequestOutput, what: str) -> list[str]:
    """Texts of the samples that ended with `stop`; most must have (the rest hit max_tokens)."""
    reasons = [o.finish_reason for o in out.outputs]
    assert set(reasons) <= {"stop", "length"}, reasons
    texts = [o.text for o in out.outputs if o.finish_reason == "stop"]
    assert len(texts) >= MIN_STOP_SHARE * len(reasons), f"{what}: finish reasons {reasons}"
    return texts


def check_json(texts: list[str], schema: dict[str, Any]) -> None:
    for text in texts:
        value = json.loads(text)
        jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def tool_llm() -> Iterator[LLM]:
    """The qwen2 fixture with a compact tool-aware chat template."""
    engine = LLM(str(QWEN2), max_model_len=MAX_MODEL_LEN, seed=0, chat_template=TOOLS_CHAT_TEMPLATE)
    yield engine
    engine.shutdown()


# ------------------------------------------------------------------------------------------------
# the parameters
# ------------------------------------------------------------------------------------------------


def test_structured_outputs_params_are_exported() -> None:
    from rserve import GuidedDecodingParams, StructuredOutputsParams

    assert GuidedDecodingParams is StructuredOutputsParams or issubclass(GuidedDecodingParams, StructuredOutputsParams)
    p = StructuredOutputsParams(choice=["a", "b"])
    assert p.choice == ["a", "b"]
    assert SamplingParams(structured_outputs=p).structured_outputs == p


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json": SCHEMA, "regex": REGEX},
        {"choice": CHOICES, "grammar": GRAMMAR},
        {"json_object": True, "regex": REGEX},
    ],
    ids=["none", "json-and-regex", "choice-and-grammar", "json_object-and-regex"],
)
def test_exactly_one_kind_is_required(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        so(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": BAD_SCHEMA},
        {"json": {"$ref": "#/$defs/missing"}},
        {"json": "{not json"},
        {"regex": "(unclosed"},
        {"choice": []},
        {"grammar": "start: missing_rule"},
        {"grammar": 'start: ("a"'},
    ],
    ids=["bad-type", "unresolved-ref", "not-json", "unclosed-regex", "empty-choice", "undefined-rule", "unclosed-group"],
)
def test_invalid_constraints_raise_value_error(llm: LLM, kwargs: dict[str, Any]) -> None:
    # refused when the parameters are built or, at the latest, when the request is submitted
    with pytest.raises(ValueError):
        params = SamplingParams(structured_outputs=so(**kwargs), max_tokens=4)
        llm.generate(PROMPT, params)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1))[0].finished


# ------------------------------------------------------------------------------------------------
# generation
# ------------------------------------------------------------------------------------------------


def test_json_schema_samples_validate(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPT, "Data:"],
        [sampled(so(json=SCHEMA), seed=1), sampled(so(json=OTHER_SCHEMA), seed=2)],
    )
    for out, schema in zip(outs, (SCHEMA, OTHER_SCHEMA)):
        assert len(out.outputs) == 8
        texts = finished_texts(out, json.dumps(schema)[:60])
        check_json(texts, schema)
    # compact by default: SCHEMA's strings hold no whitespace, so there is one way to write a value
    for text in finished_texts(outs[0], "compact"):
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False), text


def test_json_takes_a_model_class_a_dict_or_a_string(llm: LLM) -> None:
    schema = Pet.model_json_schema()
    forms = [so(json=Pet), so(json=schema), so(json=json.dumps(schema))]
    outs = llm.generate([PROMPT] * 3, [sampled(f, n=4, seed=5) for f in forms])
    texts = [[o.text for o in out.outputs] for out in outs]
    assert texts[0] == texts[1] == texts[2], texts
    for text in finished_texts(outs[0], "Pet"):
        Pet.model_validate_json(text)


OTHER_KINDS: list[tuple[str, dict[str, Any], Any]] = [
    ("regex", {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ("choice", {"choice": CHOICES}, lambda t: t in CHOICES),
    ("grammar", {"grammar": GRAMMAR}, lambda t: re.fullmatch(r"[1-9][0-9]?([+-][1-9][0-9]?)*", t) is not None),
    ("grammar-yes-no", {"grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ("json_object", {"json_object": True}, None),
    ("json-whitespace-allowed", {"json": SCHEMA, "disable_any_whitespace": False}, None),
]


@pytest.mark.parametrize("kwargs,check", [c[1:] for c in OTHER_KINDS], ids=[c[0] for c in OTHER_KINDS])
def test_other_kinds_of_constraint(llm: LLM, kwargs: dict[str, Any], check: Any) -> None:
    out = llm.generate(PROMPT, sampled(so(**kwargs), seed=3, max_tokens=60))[0]
    assert len(out.outputs) == 8
    if check is not None:
        for text in finished_texts(out, str(kwargs)):
            assert check(text), f"{text!r} is outside {kwargs}"
        return
    # unbounded JSON (any object, or whitespace allowed): samples may run out of tokens
    for o in out.outputs:
        assert o.text.lstrip()[:1] == "{", o.text
        if o.finish_reason == "stop":
            value = json.loads(o.text)
            assert isinstance(value, dict)
            if "json" in kwargs:
                jsonschema.validate(value, kwargs["json"])


def test_guided_decoding_is_a_legacy_alias(llm: LLM) -> None:
    legacy = SamplingParams(
        guided_decoding=rserve.GuidedDecodingParams(choice=CHOICES), n=8, temperature=1.0, seed=4, max_tokens=10
    )
    current = sampled(so(choice=CHOICES), seed=4, max_tokens=10)
    a, b = llm.generate([PROMPT, PROMPT], [legacy, current])
    assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
    assert all(t in CHOICES for t in finished_texts(a, "legacy choice"))


def test_stream_matches_generate(llm: LLM) -> None:
    params = SamplingParams(structured_outputs=so(json=SCHEMA), temperature=0.8, seed=12, max_tokens=100)
    outs = list(llm.stream(PROMPT, params))
    assert outs and outs[-1].finished
    assert "".join(o.outputs[0].delta for o in outs) == outs[-1].outputs[0].text
    whole = llm.generate(PROMPT, params)[0].outputs[0]
    assert (outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason) == (whole.text, whole.finish_reason)


def test_chat_with_a_schema(llm: LLM) -> None:
    out = llm.chat(MESSAGES, sampled(so(json=SCHEMA), n=4, seed=6))[0]
    check_json(finished_texts(out, "chat"), SCHEMA)


# ------------------------------------------------------------------------------------------------
# tools in the chat template
# ------------------------------------------------------------------------------------------------


def test_chat_renders_tools_into_the_prompt(tool_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = tool_llm.chat(MESSAGES, params)[0]
    with_tools = tool_llm.chat(MESSAGES, params, tools=TOOLS)[0]
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)
    assert "get_weather" in (with_tools.prompt or "") and "get_weather" not in (plain.prompt or "")
    # the arguments of a tool as structured output of the same chat
    args = SamplingParams(structured_outputs=so(json=WEATHER_PARAMS), n=4, temperature=1.0, seed=2, max_tokens=80)
    out = tool_llm.chat(MESSAGES, args, tools=TOOLS)[0]
    check_json(finished_texts(out, "tool arguments"), WEATHER_PARAMS)
