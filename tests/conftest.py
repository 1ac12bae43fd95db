"""Fixtures for the black-box HTTP tests: start `rserve serve` as a subprocess per test session.

Environment:
  RSERVE_BIN              path of the server binary (default: target/release/rserve)
  RSERVE_STARTUP_TIMEOUT  seconds to wait for GET /health == 200 (default: 60)
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))

from support.rserve_process import RserveProcess, binary_path, running  # noqa: E402

MODEL_DIR = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2"
SERVED_MODEL_NAME = "tiny-qwen"
MAX_MODEL_LEN = 256
API_KEY = "sekrit"
# flags of the `edge_server` instance: connection timeouts, a small per-request cap on choices and
# the /tokenizer_info endpoint
EDGE_ARGS = [
    "--enable-tokenizer-info-endpoint",
    "--timeout-keep-alive",
    "1",
    "--header-read-timeout",
    "2",
    "--max-choices-per-request",
    "8",
]
# flags of the main instance: tool calling with `tool_choice="auto"` (hermes-style <tool_call> blocks)
MAIN_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# ChatML with a one-line tool list, assistant tool calls as hermes `<tool_call>` blocks and tool
# results as `<tool_response>` blocks. The fixture model's own template spells out every tool as
# JSON under a long preamble, more than its 256-token context holds; the tool-calling instances
# (`tools_server`, `plain_tools_server`) serve this one instead.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for call in message.tool_calls %}\n<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# which session fixture started the instance of each name (for the log tails of failed tests)
FIXTURE_OF = {
    "main": "server",
    "auth": "auth_server",
    "edge": "edge_server",
    "tools": "tools_server",
    "tools-noauto": "plain_tools_server",
}

_STARTED: list["RserveServer"] = []


class RserveServer(RserveProcess):
    """One `rserve serve` process of the Rust binary; its stdout and stderr go to a log file."""

    def __init__(self, name: str, log_dir: Path, extra_args: list[str] | None = None):
        self.binary = binary_path()
        super().__init__(
            name,
            [str(self.binary)],
            MODEL_DIR,
            log_dir,
            served_model_name=SERVED_MODEL_NAME,
            max_model_len=MAX_MODEL_LEN,
            extra_args=extra_args,
        )

    def start(self, timeout: float) -> None:
        if not self.binary.is_file():
            pytest.fail(
                f"rserve binary not found at {self.binary}; build it with "
                "`cargo build --release` or point RSERVE_BIN at it",
                pytrace=False,
            )
        _STARTED.append(self)
        super().start(timeout)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RserveServer:
    """The main instance (no API key; auto tool choice with the hermes parser, flags in MAIN_ARGS)."""
    yield from running(RserveServer("main", tmp_path_factory.mktemp("rserve-main"), MAIN_ARGS))


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory) -> RserveServer:
    """A second instance started with `--api-key sekrit` (and /tokenizer_info, to check that it
    is behind the key too)."""
    yield from running(
        RserveServer(
            "auth",
            tmp_path_factory.mktemp("rserve-auth"),
            ["--api-key", API_KEY, "--enable-tokenizer-info-endpoint"],
        )
    )


@pytest.fixture(scope="session")
def edge_server(tmp_path_factory) -> RserveServer:
    """A third instance with short connection timeouts (header read 2 s, keep-alive 1 s), at most
    8 choices per request and the /tokenizer_info endpoint (flags in EDGE_ARGS)."""
    yield from running(RserveServer("edge", tmp_path_factory.mktemp("rserve-edge"), EDGE_ARGS))


def _tools_instance(name: str, tmp_path_factory, extra_args: list[str]):
    log_dir = tmp_path_factory.mktemp(f"rserve-{name}")
    template = log_dir / "tools_chat_template.jinja"
    template.write_text(TOOLS_CHAT_TEMPLATE)
    yield from running(RserveServer(name, log_dir, ["--chat-template", str(template), *extra_args]))


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory) -> RserveServer:
    """An instance serving TOOLS_CHAT_TEMPLATE with the main instance's flags (auto tool choice)."""
    yield from _tools_instance("tools", tmp_path_factory, MAIN_ARGS)


@pytest.fixture(scope="session")
def plain_tools_server(tmp_path_factory) -> RserveServer:
    """An instance serving TOOLS_CHAT_TEMPLATE without `--enable-auto-tool-choice`."""
    yield from _tools_instance("tools-noauto", tmp_path_factory, [])


@pytest.fixture(scope="session")
def model(server) -> str:
    return server.model_name


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    """The official OpenAI client pointed at the main instance (no retries, so errors show)."""
    c = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120.0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(server) -> httpx.Client:
    """A raw HTTP client for the main instance."""
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On failure, attach the tail of the log of every server the test used."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    names = set(getattr(item, "fixturenames", ()))
    for srv in _STARTED:
        if FIXTURE_OF.get(srv.name) in names:
            report.sections.append(
                (
                    f"rserve {srv.name} ({srv.status_line()}), log tail of {srv.log_path}",
                    srv.log_tail(),
                )
            )


def pytest_sessionfinish(session, exitstatus):
    for srv in _STARTED:
        try:
            srv.stop()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            print(f"stopping rserve {srv.name}: {e}", file=sys.stderr)
