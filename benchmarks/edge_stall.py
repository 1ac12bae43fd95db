#!/usr/bin/env python3
"""How much a hostile or careless client can stall everyone else on one rserve server.

Starts BINARY (`rserve`) on the tiny test model and, while a streamed completion runs and
`/health` is polled every 50 ms, sends:
  - two concurrent 8 MB chat prompts, then one 30 MB completions prompt (time to the answer);
  - 300 connections that send half a request head and stop (how many are open after 12 s).
Prints one JSON object: the answers' statuses and times, the longest `/health` latency and the
longest gap between the stream's chunks during each phase.

    python benchmarks/edge_stall.py target/release/rserve [--label NAME]

Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "models" / "qwen2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes, timeout: float = 300) -> tuple[int, float]:
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    except OSError:
        return -1, time.monotonic() - t0
    finally:
        c.close()


class Watch:
    """Polls /health and reads a long stream; records the worst latency and the worst gap."""

    def __init__(self, port: int):
        self.port = port
        self.stop = threading.Event()
        self.health_max = 0.0
        self.gap_max = 0.0
        self.threads = [
            threading.Thread(target=self._health, daemon=True),
            threading.Thread(target=self._stream, daemon=True),
        ]

    def __enter__(self) -> "Watch":
        for t in self.threads:
            t.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _health(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                c.request("GET", "/health")
                c.getresponse().read()
                c.close()
            except OSError:
                pass
            self.health_max = max(self.health_max, time.monotonic() - t0)
            time.sleep(0.05)

    def _stream(self) -> None:
        while not self.stop.is_set():
            body = json.dumps(
                {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            )
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            last = time.monotonic()
            while not self.stop.is_set():
                line = r.readline()
                if not line:
                    break
                now = time.monotonic()
                self.gap_max = max(self.gap_max, now - last)
                last = now
            c.close()


def chat_body(n_bytes: int) -> bytes:
    head = b'{"messages": [{"role": "user", "content": "'
    tail = b'"}], "max_tokens": 1}'
    return head + b"ab " * ((n_bytes - len(head) - len(tail)) // 3) + tail


def completion_body(n_bytes: int) -> bytes:
    head, tail = b'{"prompt": "', b'", "max_tokens": 1}'
    return head + b"ab " * ((n_bytes - len(head) - len(tail)) // 3) + tail


def half_heads(port: int, count: int, wait: float) -> int:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        s.setblocking(False)
        socks.append(s)
    time.sleep(wait)
    still = 0
    for s in socks:
        try:
            still += s.recv(1) != b""
        except BlockingIOError:
            still += 1
        except OSError:
            pass
        s.close()
    return still


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    port = free_port()
    cmd = [a.binary, "serve", str(MODEL), "--port", str(port), "--max-model-len", "512"]
    cmd += ["--max-body-bytes", str(64 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        out: dict = {"label": a.label, "binary": a.binary}
        with Watch(port) as w:
            with ThreadPoolExecutor(2) as pool:
                res = list(pool.map(lambda _: post(port, "/v1/chat/completions", chat_body(8 << 20)), range(2)))
            out["chat_8mb_x2"] = [{"status": s, "seconds": round(t, 3)} for s, t in res]
            out["chat_phase"] = {"health_max_s": round(w.health_max, 3), "stream_gap_max_s": round(w.gap_max, 3)}
            w.health_max = w.gap_max = 0.0
            s, t = post(port, "/v1/completions", completion_body(30 << 20))
            out["completion_30mb"] = {"status": s, "seconds": round(t, 3)}
            out["completion_phase"] = {"health_max_s": round(w.health_max, 3), "stream_gap_max_s": round(w.gap_max, 3)}
        out["half_heads_open_after_12s"] = half_heads(port, 300, 12.0)
        print(json.dumps(out))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
