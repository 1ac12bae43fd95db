"""Shared assertions and raw-socket helpers of the HTTP tests (httpx and h11, no fixtures)."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Sequence

import h11
import httpx

MODEL = "tiny-qwen"


def assert_error(
    resp: httpx.Response, status: int, contains: str | None = None, *, param: str | None = None
) -> dict:
    """The response is `status` with the body {"error": {"message", "type", "param", "code"}}
    (and, when given, the message contains `contains` and `error.param` is `param`)."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    ctype = resp.headers.get("content-type", "")
    assert ctype.startswith("application/json"), f"Content-Type is {ctype!r}: {resp.text[:300]}"
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    for key in ("message", "type", "param", "code"):
        assert key in err, f"error lacks {key!r}: {body}"
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], (int, str)), body
    if contains is not None:
        assert contains in err["message"], f"{contains!r} not in {err['message']!r}"
    if param is not None:
        assert err["param"] == param, f"param is {err['param']!r}, expected {param!r}: {err}"
    return err


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1, "temperature": 0}
    )
    assert r.status_code == 200, f"server stopped serving after an error: {r.status_code} {r.text}"
    assert r.json()["choices"][0]["text"] is not None


def parse_sse(resp: httpx.Response) -> list[dict]:
    """Checks SSE framing (`data: <json>\\n\\n` events ending with `data: [DONE]`); returns the JSON."""
    assert resp.status_code == 200, resp.text[:1000]
    ctype = resp.headers.get("content-type", "")
    assert ctype.startswith("text/event-stream"), f"Content-Type is {ctype!r}"
    raw = resp.text
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-200:]!r}"
    payloads = []
    for block in raw[:-2].split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # SSE comments
        if not lines:
            continue
        assert len(lines) == 1, f"event is not a single data line: {block!r}"
        assert lines[0].startswith("data: "), f"event is not `data: ...`: {block!r}"
        payloads.append(lines[0][len("data: ") :])
    assert payloads, "empty stream"
    assert payloads[-1] == "[DONE]", f"stream does not end with data: [DONE]: {payloads[-1]!r}"
    assert "[DONE]" not in payloads[:-1], "data: [DONE] before the end"
    events = []
    for p in payloads[:-1]:
        ev = json.loads(p)
        assert "error" not in ev, f"error event in stream: {ev}"
        events.append(ev)
    return events


# ------------------------------------------------------------------------------------------------
# raw sockets: requests httpx would refuse to send, or uploads the server may cut short
# ------------------------------------------------------------------------------------------------


def raw_exchange(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    timeout: float = 30.0,
) -> httpx.Response | None:
    """Sends one request (with `Connection: close`) over a plain socket and reads the answer until
    the server closes the connection. The upload stops as soon as the server answers, so an early
    413 or 431 (and a closed connection) is read instead of ending in a broken pipe.

    Returns the answer as an `httpx.Response` (for `assert_error`), or None if there was none."""
    conn = h11.Connection(our_role=h11.CLIENT)
    all_headers = [("Host", f"{host}:{port}"), *headers, ("Connection", "close")]
    if body or method not in ("GET", "HEAD"):
        all_headers.append(("Content-Length", str(len(body))))
    data = conn.send(h11.Request(method=method, target=path, headers=all_headers)) + body
    sock = socket.create_connection((host, port), timeout=timeout)
    received = b""
    try:
        sock.setblocking(False)
        view, sent = memoryview(data), 0
        deadline = time.monotonic() + timeout
        while sent < len(data) and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent += sock.send(view[sent : sent + (1 << 16)])
                except BlockingIOError:
                    continue
                except OSError:
                    break
        sock.settimeout(timeout)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    return parse_response(received)


def parse_response(received: bytes) -> httpx.Response | None:
    """The first HTTP/1.1 response in `received` (read until the connection closed), or None."""
    conn = h11.Connection(our_role=h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(received)
    conn.receive_data(b"")
    response: h11.Response | None = None
    content = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            break
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            content += event.data
        elif event in (h11.NEED_DATA, h11.PAUSED) or isinstance(
            event, (h11.EndOfMessage, h11.ConnectionClosed)
        ):
            break
    if response is None:
        return None
    return httpx.Response(
        response.status_code,
        headers=[(k.decode(), v.decode("latin-1")) for k, v in response.headers],
        content=content,
    )


def post_raw_body(host: str, port: int, path: str, body: bytes) -> httpx.Response | None:
    """POSTs a JSON `body` over a plain socket (see `raw_exchange`)."""
    return raw_exchange(host, port, "POST", path, [("Content-Type", "application/json")], body)
