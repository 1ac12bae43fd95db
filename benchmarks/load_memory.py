#!/usr/bin/env python3
"""Host memory while rserve loads a model, by what the process itself allocated: the peak of its
anonymous resident memory (`RssAnon` in /proc/PID/status, sampled every 2 ms from the start of
the process until /health answers 200), beside the peak of all its resident memory (`VmHWM`,
which also counts the checkpoint's pages mapped from the page cache as they are read, so it
cannot tell a streamed load from one that copies the whole checkpoint).

    python3 benchmarks/load_memory.py --rserve target/release/rserve

The model is a Qwen2.5-0.5B-shaped checkpoint of random bf16 weights written by
`benchmarks/make_random_checkpoint.py` (988 MB), loaded as it is (f32 on the CPU) and with
each ISQ format; with --gguf FILE a GGUF file too. The KV cache is kept small
(--kv-cache-memory) so that it does not hide the weights. Prints a markdown table and appends JSON
lines to --out. A report, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_vs_llama_cpp import append_results, cpu_model, log  # noqa: E402

KV_BYTES = 16_000_000


def status(pid: int) -> dict[str, int]:
    """The /proc status fields in KiB (what /proc calls kB)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def measure(binary: str, model: Path, flags: list[str]) -> dict:
    port = free_port()
    cmd = [binary, "serve", str(model), "--port", str(port), "--max-model-len", "256",
           "--kv-cache-memory", str(KV_BYTES), *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_anon, last_check = 0, 0.0
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"rserve {' '.join(flags)} stopped:\n{proc.stderr.read()}")
            try:
                st = status(proc.pid)
            except OSError:
                st = {}
            peak_anon = max(peak_anon, st.get("RssAnon", 0))
            now = time.perf_counter()
            if now - last_check > 0.05:
                last_check = now
                if healthy(port):
                    break
            time.sleep(0.002)
        ready = time.perf_counter() - t0
        st = status(proc.pid)
        mb = lambda kib: round(kib * 1024 / 1e6, 1)  # noqa: E731  (/proc counts KiB; MB are 10^6 bytes)
        return {"flags": " ".join(flags) or "(none)", "peak_anon_mb": mb(max(peak_anon, st["RssAnon"])),
                "anon_when_ready_mb": mb(st["RssAnon"]), "peak_rss_mb": mb(st["VmHWM"]),
                "ready_s": round(ready, 2)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rserve", default=str(ROOT / "target" / "release" / "rserve"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/rserve-bench/qwen2.5-0.5b-shape"))
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF file to load too")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-cpu-load-memory.jsonl")
    args = ap.parse_args()
    if not (args.work / "model.safetensors").exists():
        log(f"writing the checkpoint into {args.work}")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_random_checkpoint.py"), "qwen2.5-0.5b",
                        str(args.work)], check=True)
    size_mb = round((args.work / "model.safetensors").stat().st_size / 1e6, 1)
    runs = [(args.work, []), *((args.work, ["--isq", f]) for f in ("q8_0", "q6k", "q4k", "q4_0", "fp8")),
            (args.work, ["--isq", "q4k", "--isq-lm-head"])]
    if args.gguf:
        runs.append((args.gguf, []))
    rows = []
    for model, flags in runs:
        log(f"{model.name} {' '.join(flags)}")
        r = {"model": model.name, "model_mb": round(model.stat().st_size / 1e6, 1) if model.is_file() else size_mb,
             **measure(args.rserve, model, flags)}
        rows.append(r)
    meta = {"date": str(datetime.date.today()), "cpu": cpu_model(), "kv_cache_bytes": KV_BYTES}
    append_results(args.out, meta, rows)
    print("| model | flags | file (MB) | peak anonymous memory (MB) | at /health (MB) | peak RSS with mapped pages (MB) | to /health (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | `{r['flags']}` | {r['model_mb']} | {r['peak_anon_mb']} | {r['anon_when_ready_mb']} | "
              f"{r['peak_rss_mb']} | {r['ready_s']} |")


if __name__ == "__main__":
    main()
