"""Server lifecycle under load: SIGTERM lets in-flight requests finish and then exits cleanly;
a full server answers 503 with Retry-After instead of queueing without bound."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx

from support.rserve_process import RserveProcess, binary_path, startup_timeout

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "tests" / "fixtures" / "models" / "qwen2"


def _server(tmp_path: Path, name: str, extra: list[str]) -> RserveProcess:
    srv = RserveProcess(
        name,
        [str(binary_path())],
        MODEL,
        tmp_path,
        served_model_name="tiny",
        max_model_len=512,
        extra_args=extra,
    )
    srv.start(startup_timeout())
    return srv


def _stream_tokens(url: str, max_tokens: int, first_chunk: threading.Event, result: dict) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    tokens, finish = 0, None
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                tokens += 1
                finish = ch.get("finish_reason") or finish
            first_chunk.set()
    result["chunks"], result["finish"] = tokens, finish


def test_sigterm_finishes_in_flight_requests_then_exits(tmp_path: Path) -> None:
    srv = _server(tmp_path, "sigterm", ["--shutdown-timeout", "60"])
    try:
        first, result = threading.Event(), {}
        t = threading.Thread(target=_stream_tokens, args=(srv.url, 300, first, result))
        t.start()
        assert first.wait(30), "no first chunk"
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result.get("status") == 200
        assert result.get("finish") == "length", result
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()


def test_full_server_answers_503_with_retry_after(tmp_path: Path) -> None:
    srv = _server(tmp_path, "capacity", ["--max-pending", "1"])
    try:
        first, result = threading.Event(), {}
        t = threading.Thread(target=_stream_tokens, args=(srv.url, 400, first, result))
        t.start()
        assert first.wait(30), "no first chunk"
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") == "1"
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        t.join(60)
        assert result.get("finish") == "length"
        # capacity is back once the first request is done
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
