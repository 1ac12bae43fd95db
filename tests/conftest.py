"""Fixtures for the black-box HTTP tests: start `rserve serve` as a subprocess per test session.

Environment:
  RSERVE_BIN              path of the server binary (default: target/release/rserve)
  RSERVE_STARTUP_TIMEOUT  seconds to wait for GET /health == 200 (default: 60)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2"
SERVED_MODEL_NAME = "tiny-qwen"
MAX_MODEL_LEN = 256
API_KEY = "sekrit"
LOG_TAIL_CHARS = 6000

_STARTED: list["RserveServer"] = []


def _binary() -> Path:
    env = os.environ.get("RSERVE_BIN")
    path = Path(env) if env else REPO_ROOT / "target" / "release" / "rserve"
    if not path.is_absolute():
        path = (Path.cwd() / path).resolve()
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RserveServer:
    """One `rserve serve` process; its stdout and stderr go to a log file."""

    def __init__(self, name: str, log_dir: Path, extra_args: list[str] | None = None):
        self.name = name
        self.binary = _binary()
        self.port = _free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.model_name = SERVED_MODEL_NAME
        self.max_model_len = MAX_MODEL_LEN
        self.log_path = log_dir / f"rserve-{name}.log"
        self.args = [
            str(self.binary),
            "serve",
            str(MODEL_DIR),
            "--port",
            str(self.port),
            "--host",
            self.host,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--seed",
            "0",
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        if not self.binary.is_file():
            pytest.fail(
                f"rserve binary not found at {self.binary}; build it with "
                "`cargo build --release` or point RSERVE_BIN at it",
                pytrace=False,
            )
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        _STARTED.append(self)
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    self._fail_start(f"exited with code {code} before becoming healthy")
                try:
                    r = client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                    last = f"GET /health -> {r.status_code}"
                except httpx.HTTPError as e:
                    last = f"GET /health -> {type(e).__name__}"
                time.sleep(0.1)
        self._fail_start(f"not healthy after {timeout:.0f} s ({last})")

    def _fail_start(self, why: str) -> None:
        self.stop()
        pytest.fail(
            f"rserve ({self.name}) {why}\ncommand: {' '.join(self.args)}\n"
            f"--- log ({self.log_path}) ---\n{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- diagnostics -----------------------------------------------------------------------------

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        text = data[-chars:].decode("utf-8", errors="replace")
        if len(data) > chars:
            text = "...\n" + text
        return text or "(empty)"

    def status_line(self) -> str:
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        return "running" if code is None else f"EXITED with code {code}"


def _startup_timeout() -> float:
    return float(os.environ.get("RSERVE_STARTUP_TIMEOUT", "60"))


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RserveServer:
    """The main instance (no API key)."""
    srv = RserveServer("main", tmp_path_factory.mktemp("rserve-main"))
    try:
        srv.start(_startup_timeout())
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory) -> RserveServer:
    """A second instance started with `--api-key sekrit`."""
    srv = RserveServer("auth", tmp_path_factory.mktemp("rserve-auth"), ["--api-key", API_KEY])
    try:
        srv.start(_startup_timeout())
        yield srv
    finally:
        srv.stop()


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
        fixture = "server" if srv.name == "main" else "auth_server"
        if fixture in names:
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
