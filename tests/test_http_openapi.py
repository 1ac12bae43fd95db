"""GET /openapi.json describes the API, and requests generated from it (schemathesis, positive
and negative) never get a 5xx.

The schemathesis run goes against `edge_server` (at most 8 choices per request), with generated
token limits clamped to a few tokens so each request stays cheap, derandomized generation and at
most MAX_EXAMPLES requests per operation and mode."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, BaseSchema, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.errors import FailureGroup

REQUIRED_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/models/{model}",
    "/tokenize",
    "/detokenize",
    "/health",
    "/version",
]
REQUIRED_SCHEMAS = ["ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"]
MAX_EXAMPLES = 15
SEED = 20240601
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
MAX_GENERATED_TOKENS = 4
GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
EXCLUDED_PATHS = ["/metrics"]


def test_openapi_document(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200, r.text[:500]
    assert r.headers.get("content-type", "").startswith("application/json")
    doc = r.json()
    assert isinstance(doc.get("openapi"), str) and doc["openapi"].startswith("3."), doc.get("openapi")
    assert isinstance(doc.get("info"), dict) and doc["info"].get("title"), doc.get("info")
    missing = [p for p in REQUIRED_PATHS if p not in doc.get("paths", {})]
    assert not missing, f"paths missing from /openapi.json: {missing}; has {sorted(doc.get('paths', {}))}"
    schemas = doc.get("components", {}).get("schemas", {})
    missing = [s for s in REQUIRED_SCHEMAS if s not in schemas]
    assert not missing, f"component schemas missing: {missing}; has {sorted(schemas)}"
    assert "post" in doc["paths"]["/v1/chat/completions"]
    assert "get" in doc["paths"]["/v1/models/{model}"]


@pytest.fixture(scope="module")
def edge_api_schema(edge_server) -> BaseSchema:
    """The edge server's OpenAPI document, loaded by schemathesis."""
    r = httpx.get(f"{edge_server.url}/openapi.json", timeout=60)
    assert r.status_code == 200, r.text[:500]  # a readable failure if the document is missing
    config = schemathesis.Config.from_dict({"seed": SEED, "request-timeout": 60})
    schema = schemathesis.openapi.from_url(f"{edge_server.url}/openapi.json", config=config)
    schema.config.update(base_url=edge_server.url)
    return schema.exclude(path=EXCLUDED_PATHS)


def _clamp_generation(case: Case) -> None:
    """Keeps generated requests cheap: token limits of at most a few tokens (a limit that is not
    a positive integer is left alone, it is the server's to refuse)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in TOKEN_LIMITS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GENERATED_TOKENS:
            body[key] = MAX_GENERATED_TOKENS
    if case.operation.path in GENERATING_PATHS and not any(key in body for key in TOKEN_LIMITS):
        limit = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
        body[limit] = MAX_GENERATED_TOKENS


def _fuzz(operation: APIOperation, mode: GenerationMode) -> None:
    """Sends up to MAX_EXAMPLES generated requests to `operation`; raises on the first 5xx."""

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same requests every run
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each step is a server round trip
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        _clamp_generation(case)
        case.call_and_validate(checks=[not_a_server_error])

    run()


def test_generated_requests_get_no_server_error(edge_api_schema: BaseSchema) -> None:
    """Every operation of the document, with requests that fit its schema (positive) and requests
    that do not (negative): none may answer 5xx. (schemathesis's pytest plugin,
    `schemathesis.pytest.from_fixture`, does not run under pytest 9.2, hence the loop.)"""
    failures, fuzzed = [], []
    for result in edge_api_schema.get_all_operations():
        assert isinstance(result, Ok), f"invalid operation in /openapi.json: {result.err()}"
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode)
            except Unsatisfiable:
                continue  # nothing of this operation can be made invalid (e.g. GET /health)
            except (Exception, FailureGroup) as e:  # noqa: BLE001 - reported together below
                failures.append(f"{mode.value} {operation.label}: {e}")
            fuzzed.append(f"{mode.value} {operation.label}")
    assert any(label.endswith("POST /v1/chat/completions") for label in fuzzed), fuzzed
    assert not failures, "\n\n".join(failures)
