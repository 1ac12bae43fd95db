"""The server's edges: oversized input refused without stalling anyone, slow and idle clients
disconnected, a per-request cap on choices, a KV cache too small for one sequence, OpenAI error
bodies on 405 and 431, which endpoints sit behind --api-key, GET /v1/models/{id} and
/tokenizer_info.

`edge_server` (conftest.py) runs with a 2 s header read timeout, a 1 s keep-alive, at most 8
choices per request and /tokenizer_info enabled.
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import h11
import httpx
import openai
import pytest
from openai import OpenAI

from support.http_checks import (
    MODEL,
    assert_error,
    assert_still_serving,
    parse_response,
    post_raw_body,
    raw_exchange,
)
from support.rserve_process import RserveProcess, binary_path, free_port, startup_timeout

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "tests" / "fixtures" / "models" / "qwen2"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_CHOICES = 8
BIG_TEXT = "a b c " * 150_000  # 900_000 ASCII characters, thousands of times the context
assert len(BIG_TEXT) == 900_000
FAST_REFUSAL_S = 2.0
HEALTH_LATENCY_S = 0.5


@pytest.fixture
def edge_http(edge_server) -> Iterator[httpx.Client]:
    """A client of `edge_server` that opens a connection per request: the server closes idle
    ones after 1 s, and a pooled connection could be reused just as it is being closed."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=edge_server.url, timeout=60, limits=limits) as c:
        yield c


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0, **kw}


def _chat(**kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
        **kw,
    }


# ------------------------------------------------------------------------------------------------
# oversized input is refused at once, and nobody else waits for it
# ------------------------------------------------------------------------------------------------


class HealthPoller:
    """Polls GET /health on a fresh connection each time, in a thread, recording each answer."""

    def __init__(self, url: str):
        self.url = f"{url}/health"
        self.results: list[tuple[int | str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status: int | str = httpx.get(self.url, timeout=5).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.results.append((status, time.monotonic() - t0))
            self._stop.wait(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 2.0  # a few polls even when everything else was quick
        while len(self.results) < 3 and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(10)

    def check(self, limit_s: float = HEALTH_LATENCY_S) -> None:
        assert self.results, "no /health poll"
        bad = [(s, round(t, 3)) for s, t in self.results if s != 200 or t >= limit_s]
        assert not bad, f"{len(bad)} of {len(self.results)} /health polls were slow or failed: {bad[:10]}"


def _long_stream(url: str, started: threading.Event, result: dict) -> None:
    """A 200-token greedy streamed completion; records status, tokens (usage) and finish."""
    body = _cmpl(max_tokens=200, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    try:
        with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}{COMPLETIONS}", json=body) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                for ch in chunk.get("choices", []):
                    result["finish"] = ch.get("finish_reason") or result.get("finish")
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
                started.set()
    except Exception as e:  # noqa: BLE001 - reported by the test
        result["error"] = repr(e)
    finally:
        started.set()


def _timed_post(url: str, path: str, body: dict) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(path, json=body)
    return time.monotonic() - t0, r


def _check_fast_refusal(elapsed: float, r: httpx.Response, param: str) -> None:
    err = assert_error(r, 400, "maximum context length", param=param)
    assert elapsed < FAST_REFUSAL_S, f"refusal took {elapsed:.2f} s: {err['message'][:200]}"


@contextmanager
def _streaming_in_background(url: str) -> Iterator[dict]:
    started, result = threading.Event(), {}
    t = threading.Thread(target=_long_stream, args=(url, started, result), daemon=True)
    t.start()
    assert started.wait(60), "no first chunk of the background stream"
    yield result
    t.join(300)
    assert not t.is_alive(), "the background stream did not finish"
    assert "error" not in result, result
    assert result.get("status") == 200, result
    assert result.get("tokens") == 200 and result.get("finish") == "length", result


def test_oversized_chats_are_refused_fast_while_others_are_served(server, http):
    big_chat = {"model": MODEL, "messages": [{"role": "user", "content": BIG_TEXT}], "max_tokens": 1}
    head = b'{"model": "tiny-qwen", "messages": [{"role": "user", "content": "'
    tail = b'"}], "max_tokens": 1}'
    eight_mb = head + b"a" * (8_000_000 - len(head) - len(tail)) + tail
    with _streaming_in_background(server.url), HealthPoller(server.url) as health:
        with ThreadPoolExecutor(2) as pool:
            refusals = list(pool.map(lambda _: _timed_post(server.url, CHAT, big_chat), range(2)))
        for elapsed, r in refusals:
            _check_fast_refusal(elapsed, r, "messages")
        t0 = time.monotonic()
        resp = post_raw_body(server.host, server.port, CHAT, eight_mb)
        elapsed = time.monotonic() - t0
        assert resp is not None, "no HTTP response to an 8 MB chat body"
        assert_error(resp, 413)
        assert elapsed < FAST_REFUSAL_S, f"413 took {elapsed:.2f} s"
    health.check()
    assert_still_serving(http)


def test_oversized_prompts_are_refused_fast_while_others_are_served(server, http):
    with _streaming_in_background(server.url), HealthPoller(server.url) as health:
        elapsed, r = _timed_post(server.url, COMPLETIONS, _cmpl(prompt=BIG_TEXT))
        _check_fast_refusal(elapsed, r, "prompt")
        elapsed, r = _timed_post(server.url, "/tokenize", {"model": MODEL, "prompt": BIG_TEXT})
        _check_fast_refusal(elapsed, r, "prompt")
    health.check()
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------------
# slow and idle clients (edge_server: header read timeout 2 s, keep-alive 1 s)
# ------------------------------------------------------------------------------------------------

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"


def _closed_by_server(sock: socket.socket) -> bool:
    """Reads what is there; True once the server has closed the connection."""
    try:
        return sock.recv(1 << 16) == b""  # data (e.g. a 408) is read past until the close
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def _wait_closed(socks: list[socket.socket], deadline: float, on_tick=None) -> list[socket.socket]:
    """Waits until the server has closed every socket or `deadline`; returns those still open."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    try:
        open_ = set(socks)
        next_tick = time.monotonic()
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, min(0.25, deadline - time.monotonic()))):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if _closed_by_server(sock):
                    sel.unregister(sock)
                    open_.discard(sock)
            if on_tick is not None and time.monotonic() >= next_tick:
                on_tick()
                next_tick = time.monotonic() + 0.5
        return list(open_)
    finally:
        sel.close()


def _health_ok(url: str) -> None:
    r = httpx.get(f"{url}/health", timeout=HEALTH_LATENCY_S * 4)
    assert r.status_code == 200, r.text


def test_clients_stuck_in_the_request_head_are_disconnected(edge_server):
    socks: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.create_connection((edge_server.host, edge_server.port), timeout=10)
            socks.append(s)
            s.sendall(HALF_HEAD)
        last_send = time.monotonic()
        _health_ok(edge_server.url)
        still_open = _wait_closed(socks, last_send + 6.0, lambda: _health_ok(edge_server.url))
        assert not still_open, (
            f"{len(still_open)} of 300 connections with half a request head are still open "
            "6 s after the last byte (header read timeout 2 s)"
        )
    finally:
        for s in socks:
            s.close()
    _health_ok(edge_server.url)


def _read_one_response(sock: socket.socket, timeout: float = 30.0) -> h11.Response:
    """Reads one complete response to a GET from a keep-alive connection."""
    conn = h11.Connection(our_role=h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/health", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    sock.settimeout(timeout)
    response: h11.Response | None = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = sock.recv(1 << 16)
            assert data, "the connection closed before the response was complete"
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response


def test_idle_keep_alive_connection_is_closed(edge_server):
    with socket.create_connection((edge_server.host, edge_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = _read_one_response(s)
        assert response.status_code == 200
        done = time.monotonic()
        still_open = _wait_closed([s], done + 3.0)
        waited = time.monotonic() - done
        assert not still_open, "an idle keep-alive connection is still open after 3 s (keep-alive 1 s)"
        # closed by the keep-alive clock (1 s), not the header read timeout (2 s)
        assert waited < 1.9, waited


def test_slow_but_timely_request_is_served(edge_server):
    body = json.dumps(_cmpl(max_tokens=2)).encode()
    with socket.create_connection((edge_server.host, edge_server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        time.sleep(0.5)
        s.sendall(b"ication/json\r\nConnection: close\r\n")
        time.sleep(0.5)
        s.sendall(b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.3)
        s.sendall(body)
        received = b""
        while chunk := s.recv(1 << 16):
            received += chunk
    resp = parse_response(received)
    assert resp is not None, f"no response: {received[:300]!r}"
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1


# ------------------------------------------------------------------------------------------------
# --max-choices-per-request 8 (prompts x n, x best_of when it is larger than n)
# ------------------------------------------------------------------------------------------------


def test_choice_cap_counts_prompts(edge_http):
    err = assert_error(edge_http.post(COMPLETIONS, json=_cmpl(prompt=["Hi"] * 9)), 400, param="prompt")
    assert str(MAX_CHOICES) in err["message"] and "--max-choices-per-request" in err["message"], err
    r = edge_http.post(COMPLETIONS, json=_cmpl(prompt=["Hi"] * 8, n=1))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 8 and sorted(c["index"] for c in choices) == list(range(8))


def test_choice_cap_counts_n_and_best_of(edge_http):
    err = assert_error(edge_http.post(COMPLETIONS, json=_cmpl(prompt=["Hi"] * 3, n=3)), 400, param="n")
    assert "--max-choices-per-request" in err["message"], err
    err = assert_error(edge_http.post(CHAT, json=_chat(n=9)), 400, param="n")
    assert str(MAX_CHOICES) in err["message"] and "--max-choices-per-request" in err["message"], err
    # best_of samples count too: 2 prompts x best_of 5 = 10 > 8
    r = edge_http.post(COMPLETIONS, json=_cmpl(prompt=["Hi"] * 2, n=1, best_of=5))
    assert "--max-choices-per-request" in assert_error(r, 400)["message"]
    r = edge_http.post(CHAT, json=_chat(n=8))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


# ------------------------------------------------------------------------------------------------
# a KV cache smaller than one sequence of max_model_len
# ------------------------------------------------------------------------------------------------

# bytes per token: K and V x 2 layers x 2 KV heads x head_dim 16 x 4 bytes (f32) = 512;
# 8 blocks of 16 tokens = 128 tokens
KV_TOKENS = 128
KV_BYTES = KV_TOKENS * 2 * 2 * 2 * 16 * 4
assert KV_BYTES == 65536


def _binary() -> Path:
    path = binary_path()
    if not path.is_file():
        pytest.fail(f"rserve binary not found at {path}", pytrace=False)
    return path


def test_keep_alive_longer_than_the_header_timeout_is_refused():
    args = [str(_binary()), "serve", str(MODEL_DIR), "--port", str(free_port())]
    args += ["--timeout-keep-alive", "30", "--header-read-timeout", "10"]
    done = subprocess.run(args, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode != 0, out
    assert "--timeout-keep-alive" in out and "--header-read-timeout" in out, out


def test_explicit_max_model_len_larger_than_kv_cache_is_refused():
    args = [str(_binary()), "serve", str(MODEL_DIR), "--host", "127.0.0.1", "--port", str(free_port())]
    args += ["--kv-cache-memory", str(KV_BYTES), "--max-model-len", "256"]
    try:
        done = subprocess.run(
            args,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.output or b"").decode(errors="replace")
        pytest.fail(f"still running after 60 s with a 128-token cache and --max-model-len 256:\n{out}")
    out = done.stdout.decode(errors="replace")
    assert done.returncode != 0, f"exited 0:\n{out}"
    for needle in ("max_model_len", "256", str(KV_TOKENS)):
        assert needle in out, f"{needle!r} not in the output:\n{out}"


def test_default_max_model_len_is_lowered_to_the_kv_cache(tmp_path):
    srv = RserveProcess(
        "kv-small",
        [str(_binary())],
        MODEL_DIR,
        tmp_path,
        served_model_name=MODEL,
        max_model_len=None,
        extra_args=["--kv-cache-memory", str(KV_BYTES)],
    )
    srv.start(startup_timeout())
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            r = c.get("/v1/models")
            assert r.status_code == 200, r.text
            card = next(m for m in r.json()["data"] if m["id"] == MODEL)
            assert card["max_model_len"] == KV_TOKENS, card
            r = c.post(COMPLETIONS, json=_cmpl(max_tokens=2))
            assert r.status_code == 200, r.text
        log = srv.log_path.read_text(errors="replace")
        assert str(KV_TOKENS) in log, f"no word of the lowered max_model_len in the log:\n{log}"
        assert "max_model_len" in log or "max-model-len" in log, log
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------
# 405 and 431 carry the OpenAI error body
# ------------------------------------------------------------------------------------------------


def test_method_not_allowed_is_an_openai_error(http):
    assert_error(http.get(CHAT), 405)
    assert_error(http.get(COMPLETIONS), 405)
    assert_error(http.post("/health", json={}), 405)


@pytest.mark.parametrize(
    "headers",
    [[(f"X-H-{i}", "v") for i in range(150)], [("X-Big", "v" * 100_000)]],
    ids=["150-headers", "100kB-header"],
)
def test_oversized_request_head_is_431_with_an_openai_error(server, http, headers):
    resp = raw_exchange(server.host, server.port, "GET", "/health", headers)
    assert resp is not None, "no HTTP response to an oversized request head"
    assert_error(resp, 431)
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------------
# authentication of the utility endpoints (auth_server: --api-key sekrit)
# ------------------------------------------------------------------------------------------------

AUTHED_UTILITIES = [
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [10, 11, 12]}),
    ("GET", "/tokenizer_info", None),
]


@pytest.mark.parametrize("method,path,body", AUTHED_UTILITIES, ids=[p for _, p, _ in AUTHED_UTILITIES])
def test_tokenizer_endpoints_need_the_api_key(auth_server, method, path, body):
    with httpx.Client(base_url=auth_server.url, timeout=60) as c:
        assert_error(c.request(method, path, json=body), 401)
        assert_error(c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        r = c.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/openapi.json"])
def test_operational_endpoints_stay_open(auth_server, path):
    r = httpx.get(f"{auth_server.url}{path}", timeout=60)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------
# GET /v1/models/{model} and /tokenizer_info
# ------------------------------------------------------------------------------------------------


def test_retrieve_model(client: OpenAI, http):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    r = http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == MODEL and r.json()["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert_error(http.get("/v1/models/nope"), 404)


def test_tokenizer_info_is_off_by_default(http):
    assert http.get("/tokenizer_info").status_code == 404


def test_tokenizer_info(edge_http):
    r = edge_http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    assert r.headers.get("content-type", "").startswith("application/json")
    info = r.json()
    assert isinstance(info, dict), info
    assert isinstance(info.get("tokenizer_class"), str) and info["tokenizer_class"], info
    assert info.get("model_max_length") == 256, info
    # the fixture's tokenizer_config.json has a chat template
    assert isinstance(info.get("chat_template"), str) and "im_start" in info["chat_template"], info
