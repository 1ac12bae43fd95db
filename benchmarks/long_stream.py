#!/usr/bin/env python3
"""One long generation streamed to its end, through HTTP (SSE) or through `LLM.stream`, to show
how the engine thread's cost per step behaves as the output grows.

The engine logs, at debug level every 200 steps, its host time per step and the part of it spent
on the outputs (detokenizing, stop strings and sending: "detokenize + send"). This script runs
the embedded tiny model (or MODEL) with those logs on, streams TOKENS tokens (EOS ignored) and
prints one row per window of 200 steps. With outputs sent as deltas the output work per step is
flat; what grows is the forward pass's attention over the longer context.

    python benchmarks/long_stream.py http --tokens 32768 [--binary target/release/rserve]
    python benchmarks/long_stream.py python --tokens 32768       # needs the rserve package
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = re.compile(
    r"steps: ([\d.]+) tokens/step; per step ([\d.]+) ms host issue \(of which ([\d.]+) ms "
    r"schedule \+ inputs\), ([\d.]+) ms device wait \+ read \(of which ([\d.]+) ms detokenize \+ "
    r"send\), ([\d.]+) ms host after"
)
LOG = "rserve_core=debug,rserve_server=info"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def windows(log: str) -> list[tuple[float, ...]]:
    return [tuple(float(x) for x in m.groups()) for m in STEPS.finditer(log)]


def report(log: str, chunk_times: list[float], tokens: int, wall: float, label: str) -> None:
    rows = windows(log)
    print(f"# {label}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.0f} tok/s)")
    print("| steps | host issue ms/step | of which schedule + inputs | detokenize + send ms/step | host after ms/step |")
    print("|---|---:|---:|---:|---:|")
    for i, r in enumerate(rows):
        if i < 3 or i % max(1, len(rows) // 12) == 0 or i == len(rows) - 1:
            print(f"| {i * 200}-{i * 200 + 199} | {r[1]:.3f} | {r[2]:.3f} | {r[4]:.4f} | {r[5]:.4f} |")
    if rows:
        first = sum(r[4] for r in rows[:5]) / min(5, len(rows))
        last = sum(r[4] for r in rows[-5:]) / min(5, len(rows))
        print(f"detokenize + send per step: first 1,000 steps {first:.4f} ms, last 1,000 {last:.4f} ms")
    if chunk_times:
        n = len(chunk_times)
        gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        q = max(1, len(gaps) // 10)
        print(f"reader: {n} chunks; mean gap first tenth {1e3 * sum(gaps[:q]) / q:.3f} ms, last tenth {1e3 * sum(gaps[-q:]) / q:.3f} ms")


def run_http(args: argparse.Namespace) -> None:
    port = free_port()
    log_path = Path(tempfile.mkstemp(suffix=".log")[1])
    cmd = [args.binary, "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-model-len", str(args.tokens + 64)]
    env = {**os.environ, "RUST_LOG": LOG}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            for _ in range(1200):  # up to 2 minutes (a cold CUDA driver cache compiles first)
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.1)
            body = {"model": args.served_name, "prompt": "Once upon a time", "max_tokens": args.tokens,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            t0 = time.perf_counter()
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = c.getresponse()
            times = []
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    times.append(time.perf_counter())
            wall = time.perf_counter() - t0
            time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    report(log_path.read_text(), times, args.tokens, wall, f"HTTP SSE ({args.binary})")


def default_model() -> str:
    """The embedded tiny model's directory (written by any `rserve serve` without a model)."""
    base = Path(os.environ.get("RSERVE_CACHE", Path.home() / ".cache" / "rserve"))
    found = sorted(base.glob("rserve-tiny-*"))
    if not found:
        sys.exit(f"no embedded model under {base}: run `rserve serve` once, or pass --model")
    return str(found[-1])


def run_python(args: argparse.Namespace) -> None:
    args.model = args.model or default_model()
    # the child process logs the engine to stderr (RUST_LOG), which this process captures
    code = f"""
import sys, time
from rserve import LLM, SamplingParams
llm = LLM({args.model!r}, max_model_len={args.tokens + 64})
p = SamplingParams(temperature=0, max_tokens={args.tokens}, ignore_eos=True)
t0 = time.perf_counter()
n = 0
for out in llm.stream("Once upon a time", p):
    n += 1
    print("chunk", time.perf_counter(), flush=True)
print("wall", time.perf_counter() - t0, len(out.outputs[0].token_ids), flush=True)
"""
    env = {**os.environ, "RUST_LOG": LOG}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    times = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("chunk ")]
    wall_line = [line for line in r.stdout.splitlines() if line.startswith("wall ")][-1].split()
    report(r.stderr, times, int(wall_line[2]), float(wall_line[1]), "LLM.stream")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["http", "python"])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--binary", default="target/release/rserve")
    ap.add_argument("--model", default="", help="a model directory (default: the embedded tiny model)")
    ap.add_argument("--served-name", default="rserve-tiny")
    args = ap.parse_args()
    (run_http if args.mode == "http" else run_python)(args)


if __name__ == "__main__":
    main()
