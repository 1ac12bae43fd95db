"""The examples in examples/ run to completion against the tiny qwen2 fixture (each as a
subprocess, as a user would run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
QWEN2 = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2"
TIMEOUT_S = 300


def run_example(name: str, args: list[str], env: dict[str, str]) -> str:
    """Runs examples/NAME with ARGS from outside the repository; returns its stdout."""
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=Path(env.get("TMPDIR", "/tmp")),
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert r.returncode == 0, f"{name} exited with {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"
    return r.stdout


def test_offline_generate(needs_core: None, subprocess_env: dict[str, str]) -> None:
    out = run_example("offline_generate.py", [str(QWEN2)], subprocess_env)
    assert out.count("Prompt: ") == 3
    assert out.count("Generated: ") == 3
    assert "Chat reply: " in out


def test_offline_generate_default_model(needs_core: None, subprocess_env: dict[str, str]) -> None:
    out = run_example("offline_generate.py", [], subprocess_env)
    assert "Chat reply: " in out


def test_async_stream(needs_core: None, subprocess_env: dict[str, str]) -> None:
    out = run_example("async_stream.py", [str(QWEN2)], subprocess_env)
    assert "[a] " in out and "[b] " in out
    assert "final [a]: " in out and "final [b]: " in out


def test_openai_client(http_server: Any, subprocess_env: dict[str, str]) -> None:
    pytest.importorskip("openai")
    out = run_example("openai_client.py", [f"{http_server.url}/v1"], subprocess_env)
    assert f"model: {http_server.model_name}" in out
    assert "chat: " in out
    assert "streamed completion: " in out


def test_openai_client_base_url_from_env(http_server: Any, subprocess_env: dict[str, str]) -> None:
    pytest.importorskip("openai")
    env = {**subprocess_env, "OPENAI_BASE_URL": f"{http_server.url}/v1", "OPENAI_API_KEY": "x"}
    out = run_example("openai_client.py", [], env)
    assert "chat: " in out
