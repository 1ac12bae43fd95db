"""An `rserve serve` subprocess for tests: a free port, a log file, GET /health polling, SIGTERM.

Standard library and pytest only (no httpx), so the Python API tests can use it too.

Environment:
  RSERVE_BIN              path of the server binary (default: target/release/rserve)
  RSERVE_STARTUP_TIMEOUT  seconds to wait for GET /health == 200 (default: 60)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, Sequence, TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 6000
STOP_TIMEOUT = 15.0


def binary_path() -> Path:
    """The server binary: `$RSERVE_BIN` (relative to the working directory) or target/release/rserve.

    The path may not exist; callers decide what that means."""
    env = os.environ.get("RSERVE_BIN")
    path = Path(env) if env else REPO_ROOT / "target" / "release" / "rserve"
    if not path.is_absolute():
        path = (Path.cwd() / path).resolve()
    return path


def startup_timeout() -> float:
    return float(os.environ.get("RSERVE_STARTUP_TIMEOUT", "60"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RserveProcess:
    """One `<command> serve <model_dir> ...` process on a free port; stdout and stderr go to a log file.

    `command` is the server binary or the Python console script (as a list of arguments).
    With `max_model_len=None`, no `--max-model-len` is passed (the server picks its default)."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        model_dir: Path,
        log_dir: Path,
        *,
        served_model_name: str,
        max_model_len: int | None,
        extra_args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.name = name
        self.host = "127.0.0.1"
        self.port = free_port()
        self.url = f"http://{self.host}:{self.port}"
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.log_path = log_dir / f"rserve-{name}.log"
        self.env = dict(env) if env is not None else None
        self.args = [
            *command,
            "serve",
            str(model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--served-model-name",
            served_model_name,
            *(["--max-model-len", str(max_model_len)] if max_model_len is not None else []),
            "--seed",
            "0",
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Spawns the process and waits until GET /health answers 200; fails the test otherwise."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self._fail_start(f"exited with code {code} before becoming healthy")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
                    last = f"GET /health -> {r.status}"
            except urllib.error.HTTPError as e:
                last = f"GET /health -> {e.code}"
            except (urllib.error.URLError, OSError) as e:
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
        """SIGTERM, then SIGKILL if the process has not exited after STOP_TIMEOUT seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    # -- diagnostics -----------------------------------------------------------------------------

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        text = data[-chars:].decode("utf-8", errors="replace")
        return ("...\n" + text if len(data) > chars else text) or "(empty)"

    def status_line(self) -> str:
        if self.proc is None:
            return "not started"
        code = self.proc.poll()
        return "running" if code is None else f"EXITED with code {code}"


P = TypeVar("P", bound=RserveProcess)


def running(srv: P, timeout: float | None = None) -> Iterator[P]:
    """For session fixtures (`yield from running(srv)`): starts `srv`, yields it, stops it."""
    try:
        srv.start(startup_timeout() if timeout is None else timeout)
        yield srv
    finally:
        srv.stop()
