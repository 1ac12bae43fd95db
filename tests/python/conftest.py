"""Fixtures for the Python API tests (`rserve.LLM` in-process, the `rserve` console script, the
examples).

The tests need the native module `rserve._core` (`maturin develop --release` builds it). Without
it they are skipped, and the end of the run says so loudly; set `RSERVE_REQUIRE_CORE=1` to make a
missing native module an error instead.

Environment:
  RSERVE_BIN              the server binary for the HTTP comparisons (default: target/release/rserve;
                          the console script when that does not exist)
  RSERVE_STARTUP_TIMEOUT  seconds to wait for GET /health == 200 (default: 60)
  RSERVE_REQUIRE_CORE     1: fail instead of skipping when rserve._core cannot be imported
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))

from support.rserve_process import RserveProcess, binary_path, running  # noqa: E402

PYTHON_SRC = REPO_ROOT / "python"
MODELS = REPO_ROOT / "tests" / "fixtures" / "models"
QWEN2 = MODELS / "qwen2"
SERVED_MODEL_NAME = "tiny-qwen"
MAX_MODEL_LEN = 256
HUB_REPO = "acme/tiny"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"

# Without an installed package, test the source tree (where `maturin develop` puts the native module).
_FROM_SOURCE = importlib.util.find_spec("rserve") is None
if _FROM_SOURCE:
    sys.path.insert(0, str(PYTHON_SRC))

try:
    import rserve._core  # noqa: F401

    CORE_ERROR: str | None = None
except ImportError as e:
    CORE_ERROR = f"{type(e).__name__}: {e}"

CORE_SKIP_REASON = (
    f"rserve._core (the native module) cannot be imported ({CORE_ERROR}); "
    "build it with `maturin develop --release` or `pip install .`"
)


def pytest_configure(config: pytest.Config) -> None:
    if CORE_ERROR and os.environ.get("RSERVE_REQUIRE_CORE", "") not in ("", "0"):
        raise pytest.UsageError(f"RSERVE_REQUIRE_CORE is set but {CORE_SKIP_REASON}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    """Makes a missing native module impossible to overlook."""
    if not CORE_ERROR:
        return
    skipped = [
        r
        for r in terminalreporter.stats.get("skipped", [])
        if "rserve._core" in str(getattr(r, "longrepr", ""))
    ]
    terminalreporter.section("rserve Python API tests NOT RUN", sep="!", red=True, bold=True)
    terminalreporter.write_line(
        f"{len(skipped)} test(s)/module(s) were skipped because {CORE_SKIP_REASON}.",
        red=True,
        bold=True,
    )


# ------------------------------------------------------------------------------------------------
# subprocesses
# ------------------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment for Python subprocesses: they import the same `rserve` as this process."""
    env = dict(os.environ)
    if _FROM_SOURCE:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_SRC), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """`child_env()` as a fixture."""
    return child_env()


def console_script() -> list[str]:
    """The command of the installed `rserve` console script (`python -m rserve.cli` without one)."""
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        path = Path(scripts) / "rserve"
        try:
            if path.is_file() and path.read_bytes()[:2] == b"#!":  # a script, not the Rust binary
                return [str(path)]
        except OSError:
            continue
    return [sys.executable, "-m", "rserve.cli"]


@pytest.fixture(scope="session")
def console_command() -> list[str]:
    """`console_script()` as a fixture (skips without the native module)."""
    if CORE_ERROR:
        pytest.skip(CORE_SKIP_REASON)
    return console_script()


def _binary() -> Path | None:
    path = binary_path()
    return path if path.is_file() else None


def _serve(name: str, command: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RserveProcess]:
    """`rserve serve` of the qwen2 fixture run through `command`, with the environment of `child_env()`."""
    srv = RserveProcess(
        name,
        command,
        QWEN2,
        tmp_path_factory.mktemp(f"rserve-{name}"),
        served_model_name=SERVED_MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        env=child_env(),
    )
    yield from running(srv)


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RserveProcess]:
    """The HTTP server to compare against: the Rust binary, or the console script without one."""
    binary = _binary()
    if binary is None and CORE_ERROR:
        pytest.skip(f"no rserve binary (target/release/rserve) and {CORE_SKIP_REASON}")
    yield from _serve("http", [str(binary)] if binary else console_script(), tmp_path_factory)


@pytest.fixture(scope="session")
def script_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RserveProcess]:
    """`rserve serve` run through the Python package's console script."""
    if CORE_ERROR:
        pytest.skip(CORE_SKIP_REASON)
    yield from _serve("script", console_script(), tmp_path_factory)


@pytest.fixture
def needs_core() -> None:
    """Skips a test when the native module is missing."""
    if CORE_ERROR:
        pytest.skip(CORE_SKIP_REASON)


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen2_dir() -> Path:
    return QWEN2


@pytest.fixture(scope="session")
def llm():  # noqa: ANN201 - rserve.LLM, imported lazily
    """The tiny qwen2 fixture (random weights; EOS id 3; ChatML) with a 256-token context."""
    if CORE_ERROR:
        pytest.skip(CORE_SKIP_REASON)
    from rserve import LLM

    engine = LLM(str(QWEN2), max_model_len=MAX_MODEL_LEN, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A Hugging Face cache holding the qwen2 fixture as `acme/tiny`; returns the offline env for it."""
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / f"models--{HUB_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    for f in QWEN2.iterdir():
        try:
            (snapshot / f.name).symlink_to(f)
        except OSError:
            shutil.copy(f, snapshot / f.name)
    return {
        "HF_HOME": str(root / "home"),
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_HUB_OFFLINE": "1",
        "SNAPSHOT": str(snapshot),
    }
