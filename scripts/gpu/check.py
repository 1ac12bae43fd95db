#!/usr/bin/env python3
"""GPU correctness and first throughput figures, against transformers on the same GPU.

Run by scripts/gpu/check.sh on the GPU machine (torch, transformers and tokenizers installed there;
nothing is built). Each part writes a JSON line to OUT/results.jsonl and the last part prints a table.

Parts (choose with --parts, comma-separated):
  tiny     bf16 teacher-forced log-probs of the five tiny checkpoints vs transformers bf16 on the GPU
  batch    256 concurrent requests of mixed lengths through the server; greedy outputs of every tiny
           model equal to their one-at-a-time results
  big      Llama-3.1-8B and Qwen2.5-7B shapes, random bf16 weights made here: teacher-forced log-probs
           of 1,000 positions vs transformers bf16; load time; decode throughput at batch 1 and 64
           next to transformers eager generate in the same run
  coldstart  launch -> /health -> first token with an empty and a warm driver JIT cache
  startup  `rserve bench startup` (process start -> /health -> first token of a 16-token completion,
           the server's phases) for the embedded model and the Llama-3.2-1B and Llama-3.1-8B shapes,
           with the driver's JIT cache disabled (CUDA_CACHE_DISABLE=1) and then enabled and warm;
           the page cache is warm after the first run (a --cold run when the machine lets us drop it)
  quant    the first --big shape served bf16 and with each --isq format in RSERVE_QUANT (default
           bf16,fp8,q8_0,q4k): load time to /health (weights in the page cache), peak host RSS, the
           startup ISQ line, teacher-forced log-prob error against the bf16 model, batch-1 decode,
           and 256 concurrent requests for the formats in RSERVE_QUANT_C256 (default bf16,fp8); a
           format FORMAT+kv8 adds --kv-cache-dtype fp8 (bf16+kv8: the FP8 cache alone)
  vision   Qwen2.5-VL-7B's shape (scripts/gpu/check_vision.py): parity with an image, TTFT of a
           1024x1024 image against transformers, 64 concurrent image requests against text-only,
           decode speed with an image
  lora     the first --big shape with 64 rank-16 adapters: 64 concurrent requests over 1, 8 and 64
           adapters against the base, batch-1 decode with one adapter, a runtime adapter load

RSERVE_SERVE_ARGS (e.g. `--enforce-eager`) is appended to every `rserve serve` command line.
RSERVE_PROFILE_SCENARIOS (e.g. `c256-mixed,c256-decode`) picks the `profile` part's scenarios, and
RSERVE_PROFILE_ARGS (e.g. `--isq q4k`) adds server arguments to them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TINY = ["llama3", "llama2", "mistral", "qwen2", "qwen3"]


def log(*a: object) -> None:
    print(*a, flush=True)


class Server:
    """`rserve serve` on a port; stopped with SIGTERM."""

    def __init__(
        self, binary: Path, model: str, port: int, out: Path, *extra: str, env: dict | None = None,
        prefix: list[str] | None = None, tag: str = "",
    ) -> None:
        self.port = port
        self.wrapped = bool(prefix)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = out / f"server-{port}-{Path(model).name}{tag}.log"
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            [*(prefix or []), str(binary), "serve", model, "--port", str(port), "--device", "cuda", *extra,
             *shlex.split(os.environ.get("RSERVE_SERVE_ARGS", ""))],
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.ready_s = self.wait()

    def wait(self, timeout: float = 600) -> float:
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.time() - self.t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def post_text(self, path: str, body: dict, timeout: float = 600) -> str:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models") as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.wrapped:
            # the profiler writes its report when the server (its child) exits
            subprocess.run(["pkill", "-TERM", "-x", "rserve"])
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(300 if self.wrapped else 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        subprocess.run(["pkill", "-KILL", "-x", "rserve"])


def teacher_forced_rserve(srv: Server, ids: list[int]) -> tuple[list[float], list[int]]:
    """Log-prob of each next token and the arg-max at each position (positions 1..n-1)."""
    r = srv.post(
        "/v1/completions",
        {
            "model": srv.model_name(),
            "prompt": ids,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "temperature": 0,
        },
    )
    lp = r["choices"][0]["logprobs"]
    n = len(ids)
    token_lps = [float(x) for x in lp["token_logprobs"][1:n]]
    argmax = []
    for top in lp["top_logprobs"][1:n]:
        best = max(top.items(), key=lambda kv: kv[1])[0]
        argmax.append(int(best.split(":")[-1]))
    return token_lps, argmax


def teacher_forced_hf(model, ids: list[int]):
    import torch

    with torch.no_grad():
        x = torch.tensor([ids], device="cuda")
        logits = model(input_ids=x).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    tgt = torch.tensor(ids[1:], device="cuda")
    token_lps = lp[:-1].gather(1, tgt[:, None])[:, 0]
    top2 = torch.topk(logits[:-1], 2, dim=-1)
    margin = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    return token_lps.tolist(), top2.indices[:, 0].tolist(), margin


def compare(name: str, hf, rs) -> dict:
    hf_lp, hf_arg, margin = hf
    rs_lp, rs_arg = rs
    errs = [abs(a - b) for a, b in zip(hf_lp, rs_lp)]
    decided = [i for i, m in enumerate(margin) if m > 0.05]
    agree = sum(1 for i in decided if hf_arg[i] == rs_arg[i])
    return {
        "model": name,
        "positions": len(errs),
        "mean_abs_err": sum(errs) / max(len(errs), 1),
        "max_abs_err": max(errs, default=0.0),
        "argmax_checked": len(decided),
        "argmax_agree": agree,
    }


def emit(out: Path, rec: dict) -> None:
    log(json.dumps(rec))
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def part_tiny(a, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for name in TINY:
        d = FIXTURES / "models" / name
        golden = json.loads((FIXTURES / "goldens" / f"{name}.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        seqs = [c["prompt"] + c["tokens"] for c in golden["cases"]]
        hf = [teacher_forced_hf(model, s) for s in seqs]
        del model
        torch.cuda.empty_cache()
        srv = Server(a.binary, str(d), a.port, out, "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3")
        try:
            rs = [teacher_forced_rserve(srv, s) for s in seqs]
        finally:
            srv.stop()
        merged = (
            [x for h in hf for x in h[0]],
            [x for h in hf for x in h[1]],
            [x for h in hf for x in h[2]],
        )
        rec = compare(name, merged, ([x for r in rs for x in r[0]], [x for r in rs for x in r[1]]))
        rec.update(part="tiny-bf16")
        emit(out, rec)


def part_batch(a, out: Path) -> None:
    import random

    for name in TINY:
        d = FIXTURES / "models" / name
        srv = Server(a.binary, str(d), a.port, out, "--gpu-memory-utilization", "0.3")
        try:
            model = srv.model_name()
            rng = random.Random(7)
            reqs = []
            for i in range(256):
                plen = rng.choice([1, 3, 17, 64, 150, 400])
                reqs.append(
                    {
                        "model": model,
                        "prompt": [rng.randrange(20, 900) for _ in range(plen)],
                        "max_tokens": rng.choice([1, 8, 33, 64]),
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_tokens_as_token_ids": True,
                        "logprobs": 0,
                    }
                )

            def ids(r: dict) -> list[str]:
                return r["choices"][0]["logprobs"]["tokens"]

            t0 = time.time()
            with cf.ThreadPoolExecutor(256) as ex:
                together = list(ex.map(lambda r: ids(srv.post("/v1/completions", r)), reqs))
            conc_s = time.time() - t0
            alone = [ids(srv.post("/v1/completions", r)) for r in reqs[:48]]
            same = sum(1 for x, y in zip(together, alone) if x == y)
            rec = {
                "part": "batch",
                "model": name,
                "requests": len(reqs),
                "completed": sum(1 for t in together if len(t) > 0),
                "concurrent_s": conc_s,
                "checked_alone": len(alone),
                "equal_alone": same,
            }
        finally:
            srv.stop()
        emit(out, rec)


def word_tokenizer(vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def make_big(kind: str, root: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = root / kind
    if kind == "llama-3.1-8b":
        cfg = LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            bos_token_id=1, eos_token_id=2,
        )
        cls = LlamaForCausalLM
    elif kind == "llama-3.2-1b":
        cfg = LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            bos_token_id=1, eos_token_id=2,
        )
        cls = LlamaForCausalLM
    else:
        cfg = Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2,
        )
        cls = Qwen2ForCausalLM
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    if not (path / "config.json").exists():
        model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
        word_tokenizer(cfg.vocab_size, path)
    log(f"{kind}: made and saved in {time.time() - t0:.1f}s")
    return model, path


def hf_generate_tps(model, batch: int, prompt_len: int, new: int) -> float:
    import torch

    x = torch.randint(20, 900, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        model.generate(x[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.time()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        prefill = time.time() - t0
        t0 = time.time()
        model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        total = time.time() - t0
    return batch * (new - 1) / max(total - prefill, 1e-9)


def bench(a, srv: Server, out: Path, conc: int, prompts: int, inp: int, outp: int,
          model: str | None = None) -> dict:
    r = subprocess.run(
        [str(a.binary), "bench", "serve", "--base-url", srv.url + "/v1", "--model", model or srv.model_name(),
         "--num-prompts", str(prompts), "--max-concurrency", str(conc), "--random-input-len", str(inp),
         "--random-output-len", str(outp), "--json"],
        capture_output=True, text=True, timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def part_big(a, out: Path) -> None:
    import torch

    root = Path(a.scratch)
    root.mkdir(parents=True, exist_ok=True)
    for kind in a.big.split(","):
        model, path = make_big(kind, root)
        g = torch.Generator().manual_seed(1)
        ids = [1] + torch.randint(20, 30000, (1000,), generator=g).tolist()
        hf = teacher_forced_hf(model, ids)
        tps = {}
        # the float32 computation of the same weights: how far is each bf16 implementation from it?
        model.float()
        ref = teacher_forced_hf(model, ids)
        model.to(torch.bfloat16)
        torch.cuda.empty_cache()
        ref_of_hf = compare(kind, ref, (hf[0], hf[1]))
        if kind == "llama-3.1-8b":
            for b in (1, 64):
                tps[b] = hf_generate_tps(model, b, 512, 256)
                log(f"transformers eager generate batch {b}: {tps[b]:.1f} tok/s")
        del model
        torch.cuda.empty_cache()
        subprocess.run(["sync"])
        srv = Server(
            a.binary, str(path), a.port, out, "--max-model-len", "9000",
            env={"RUST_LOG": "warn,rserve_core::engine=debug,rserve_core::model_runner=info"},
        )
        try:
            rs = teacher_forced_rserve(srv, ids)
            rec = compare(kind, hf, rs)
            serving = [ln for ln in srv.log_path.read_text().splitlines() if "rserve: serving" in ln]
            rec.update(part="big-parity", ready_s=srv.ready_s, startup=serving[-1:] if serving else [])
            emit(out, rec)
            vs_f32 = compare(kind, ref, rs)
            emit(out, {"part": "big-vs-f32", "model": kind,
                       "rserve_bf16": {k: vs_f32[k] for k in ("mean_abs_err", "max_abs_err", "argmax_checked", "argmax_agree")},
                       "transformers_bf16": {k: ref_of_hf[k] for k in ("mean_abs_err", "max_abs_err", "argmax_checked", "argmax_agree")}})
            if tps:
                b1 = bench(a, srv, out, 1, 4, 512, 256)
                b64 = bench(a, srv, out, 64, 128, 512, 256)
                emit(out, {
                    "part": "big-throughput", "model": kind,
                    "rserve_b1_decode_tok_s": 1000.0 / b1["tpot_ms"]["median"],
                    "rserve_b1": b1, "rserve_b64": b64,
                    "rserve_b64_output_tok_s": b64["output_throughput"],
                    "rserve_b64_decode_tok_s": 64 * 1000.0 / b64["tpot_ms"]["median"],
                    "hf_eager_b1_decode_tok_s": tps[1], "hf_eager_b64_decode_tok_s": tps[64],
                })
                b256 = bench(a, srv, out, 256, 256, 512, 256)
                long = bench(a, srv, out, 1, 2, 8192, 16)
                emit(out, {
                    "part": "big-more", "model": kind,
                    "c256_output_tok_s": b256["output_throughput"], "c256_ttft_ms": b256["ttft_ms"],
                    "c256_itl_ms": b256["itl_ms"], "ttft_8192_ms": long["ttft_ms"],
                })
                steps = [ln.strip()[-160:] for ln in srv.log_path.read_text().splitlines() if "steps:" in ln]
                emit(out, {"part": "big-steps", "model": kind, "lines": steps[-12:]})
        finally:
            srv.stop()
        shutil.rmtree(path, ignore_errors=True)


NCU_TIME_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
NCU_BYTES = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}


def ncu_summary(csv_path: Path, steps: int) -> dict:
    """Per-kernel device time from an `ncu --csv` log: totals per kernel name, per profiled step."""
    import csv

    lines = csv_path.read_text(errors="replace").splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return {"error": "no ncu rows", "tail": lines[-20:]}
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(lines[start:]):
        k = kernels.setdefault(row["Kernel Name"][:90], {"us": 0.0, "n": 0, "bytes": 0.0})
        v = float(row["Metric Value"].replace(",", "") or 0)
        if row["Metric Name"] == "gpu__time_duration.sum":
            k["us"] += v * NCU_TIME_US[row["Metric Unit"]]
            k["n"] += 1
        else:  # dram bytes read / written
            k["bytes"] += v * NCU_BYTES[row["Metric Unit"]]
    total = sum(k["us"] for k in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:25]
    return {
        "steps": steps, "launches_per_step": sum(k["n"] for k in kernels.values()) / steps,
        "device_us_per_step": round(total / steps, 1),
        "top": [{"kernel": n, "us_per_step": round(k["us"] / steps, 1), "launches_per_step": k["n"] / steps,
                 "mb_per_step": round(k["bytes"] / steps / 1e6, 1),
                 "gb_s": round(k["bytes"] / max(k["us"], 1e-9) / 1e3)}
                for n, k in top],
    }


def fresh_checkpoint(kind: str, root: Path, keep_model: bool = False):
    """The random checkpoint of `kind` on disk (and, if asked, the transformers model, else freed)."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    model, path = make_big(kind, root)
    if not keep_model:
        del model
        model = None
        torch.cuda.empty_cache()
        subprocess.run(["sync"])
    return model, path


def part_profile(a, out: Path) -> None:
    """ncu over a few engine steps of the 8B shape: batch-1 decode, batch-64 decode, an 8k prompt,
    two mixed steps of 64 concurrent 1024-token prompts. RSERVE_PROFILE_LORA=N: requests are
    spread over N rank-16 adapters on all seven projections (1: one adapter)."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    kind = a.big.split(",")[0]
    _, path = fresh_checkpoint(kind, Path(a.scratch))
    scenarios = [("b1", 1, 2, 512, 256, 150, 2), ("b64", 64, 64, 512, 256, 200, 1),
                 ("p8k", 1, 1, 8192, 2, 0, 4),
                 # 256 concurrent requests: two mixed steps of the prefill phase (8,192-token budget), two
                 # decode steps
                 ("c256-mixed", 256, 256, 512, 256, 5, 2), ("c256-decode", 256, 256, 512, 256, 150, 2),
                 # 64 concurrent 1024-token prompts (the LoRA mix's load): two steps of its prefill phase
                 ("c64-mixed", 64, 64, 1024, 256, 6, 2)]
    only = os.environ.get("RSERVE_PROFILE_SCENARIOS")
    if only:
        scenarios = [s for s in scenarios if s[0] in only.split(",")]
    for tag, conc, prompts, inp, outp, start, count in scenarios:
        csv_path = out / f"ncu-{tag}.csv"
        prefix = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
                  "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum",
                  "--csv", "--log-file", str(csv_path)]
        extra = shlex.split(os.environ.get("RSERVE_PROFILE_ARGS", ""))  # e.g. --isq q4k
        model, names = None, []
        n_lora = int(os.environ.get("RSERVE_PROFILE_LORA", "0") or 0)
        if n_lora > 0:
            adapters = make_adapters(path, Path(a.scratch) / "adapters", n_lora)
            names = [f"a{i}" for i in range(n_lora)]
            extra += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", str(n_lora),
                      "--lora-modules", *[f"{n}={d}" for n, d in zip(names, adapters)]]
            model = names[0]
        srv = Server(a.binary, str(path), a.port, out, "--max-model-len", "9000", *extra, prefix=prefix,
                     tag=f"-ncu-{tag}",
                     env={"RSERVE_CUDA_PROFILE_STEPS": f"{start}:{count}"})
        try:
            if len(names) > 1:
                r = bench_mix(a, srv, names, conc, prompts, inp, outp)
            else:
                r = bench(a, srv, out, conc, prompts, inp, outp, model)
        finally:
            srv.stop()
        emit(out, {"part": "profile", "model": kind, "scenario": tag, "args": extra, "request_model": model, **ncu_summary(csv_path, count),
                   "bench_tpot_ms": r.get("tpot_ms"), "bench_ttft_ms": r.get("ttft_ms")})
    shutil.rmtree(path, ignore_errors=True)


def speed_benches(a, srv, out: Path, want: list, rec: dict, kind: str) -> None:
    """The serving benchmarks named in `want` against a running server, into `rec`."""
    if "b1" in want:
        b1 = bench(a, srv, out, 1, 4, 512, 256)
        rec["b1_decode_tok_s"] = 1000.0 / b1["tpot_ms"]["median"]
        rec["b1_tpot_ms"] = b1["tpot_ms"]
        rec["b1_ttft_ms"] = b1["ttft_ms"]["median"]
    if "b64" in want:
        b64 = bench(a, srv, out, 64, 128, 512, 256)
        rec["b64_decode_tok_s"] = 64 * 1000.0 / b64["tpot_ms"]["median"]
        rec["b64_output_tok_s"] = b64["output_throughput"]
    if "c256" in want:
        c = bench(a, srv, out, 256, 256, 512, 256)
        rec.update(c256_output_tok_s=c["output_throughput"], c256_ttft_ms=c["ttft_ms"],
                   c256_itl_ms=c["itl_ms"])
    if "p8k" in want:
        long = bench(a, srv, out, 1, 2, 8192, 16)
        rec["ttft_8192_ms"] = long["ttft_ms"]
    if "sweep" in want:
        rec["sweep"] = {}
        for conc in (1, 8, 32, 64, 128, 256):
            r = bench(a, srv, out, conc, max(2 * conc, 8), 1024, 256)
            rec["sweep"][conc] = {
                "output_tok_s": round(r["output_throughput"], 1),
                "ttft_ms_p50": round(r["ttft_ms"]["median"], 1), "ttft_ms_p99": round(r["ttft_ms"]["p99"], 1),
                "itl_ms_p50": round(r["itl_ms"]["median"], 2), "itl_ms_p99": round(r["itl_ms"]["p99"], 2),
            }
            log(kind, conc, rec["sweep"][conc])


def part_speed(a, out: Path) -> None:
    """Serving figures without the transformers side: batch 1 and 64 decode, 256 concurrent
    requests, an 8k prompt's TTFT, and (with `sweep` in --speed) the concurrency sweep; for each
    model shape in --big. With RSERVE_AB_ENV="NAME=VALUE ...", RSERVE_AB_ARGS="--flag value" and/or
    RSERVE_AB_BINARY=PATH (another build) each shape is served a second time with those variables
    set, flags added and that binary (an A/B on one checkpoint and one machine; RSERVE_AB_ENV="A=1|A=1
    B=1" serves one more time per `|`-separated set of variables); RSERVE_AB_ROUNDS=N
    repeats the pair N times, interleaved. RSERVE_SPEED_SETS="ARGS;ARGS;..." serves the checkpoint
    once per set of server arguments (e.g. ";--isq fp8 --kv-cache-dtype fp8;--isq q4k": bf16,
    then the two formats), each with its A/B pair."""
    import torch

    want = a.speed.split(",")
    arg_sets = [shlex.split(x) for x in os.environ.get("RSERVE_SPEED_SETS", "").split(";")]
    ab_envs = [dict(kv.split("=", 1) for kv in shlex.split(chunk))
               for chunk in os.environ.get("RSERVE_AB_ENV", "").split("|")]
    ab_envs = [e for e in ab_envs if e] or [{}]
    ab_args = shlex.split(os.environ.get("RSERVE_AB_ARGS", ""))
    ab_binary = Path(os.environ["RSERVE_AB_BINARY"]) if os.environ.get("RSERVE_AB_BINARY") else None
    rounds = int(os.environ.get("RSERVE_AB_ROUNDS", "1"))
    for kind in a.big.split(","):
        model, path = fresh_checkpoint(kind, Path(a.scratch), keep_model="hf" in want)
        hf: dict = {}
        if model is not None:
            # transformers eager generate in the same run, the side-by-side peer
            hf["hf_eager_b1_decode_tok_s"] = hf_generate_tps(model, 1, 512, 256)
            if "b64" in want:
                hf["hf_eager_b64_decode_tok_s"] = hf_generate_tps(model, 64, 512, 256)
            log(kind, hf)
            del model
            torch.cuda.empty_cache()
            subprocess.run(["sync"])
        pair = [({}, [], a.binary, "")]
        for n, ab_env in enumerate(ab_envs):
            if ab_env or ab_args or ab_binary:
                pair.append((ab_env, ab_args, ab_binary or a.binary, "-ab" + (str(n + 1) if n else "")))
        variants = [(v, base + x, b, f"-s{i}{t}" if len(arg_sets) > 1 else t)
                    for i, base in enumerate(arg_sets) for v, x, b, t in pair * rounds]
        for variant, extra, binary, tag in variants:
            rec: dict = {"part": "speed", "model": kind, **hf}
            if variant:
                rec["env"] = variant
            if extra:
                rec["args"] = extra
            if ab_binary:
                rec["binary"] = str(binary)
            srv = Server(binary, str(path), a.port, out, "--max-model-len", "9000", *extra,
                         env={"RUST_LOG": "warn,rserve_core::engine=debug,rserve_core::model_runner=info,"
                                          "rserve_core::model_runner::graphs=debug",
                              **variant}, tag=tag)
            rec["ready_s"] = srv.ready_s
            rec["peak_rss_gb"] = peak_rss_gb(srv.proc.pid)
            rec["startup"] = startup_lines(srv)
            try:
                speed_benches(a, srv, out, want, rec, kind)
            except Exception as e:  # keep what was measured
                rec["error"] = repr(e)[-2000:]
            finally:
                srv.stop()
            rec["steps"] = [ln.strip()[-130:] for ln in srv.log_path.read_text().splitlines() if "steps:" in ln][-8:]
            emit(out, rec)
        shutil.rmtree(path, ignore_errors=True)


def peak_rss_gb(pid: int) -> float | None:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) / 1e6
    except OSError:
        pass
    return None


def startup_lines(srv: Server) -> list[str]:
    """The server log's lines on ISQ, the GPU memory (load peak, KV cache budget) and the start."""
    lines = srv.log_path.read_text().splitlines()
    return [ln.strip()[-500:] for ln in lines
            if "ISQ" in ln or "rserve: serving" in ln or "KV cache" in ln][-4:]


def part_quant(a, out: Path) -> None:
    """ISQ formats on the 8B shape against bf16, one machine, one checkpoint."""
    import torch

    kind = a.big.split(",")[0]
    model, path = fresh_checkpoint(kind, Path(a.scratch), keep_model=True)
    g = torch.Generator().manual_seed(1)
    ids = [1] + torch.randint(20, 30000, (1000,), generator=g).tolist()
    formats = os.environ.get("RSERVE_QUANT", "bf16,fp8,q8_0,q4k").split(",")
    # transformers' bf16 model, then the same with every decoder projection's weight and input
    # rounded as `--isq fp8` does (E4M3, a scale per output channel / per token): what the format
    # itself costs, and the reference rserve's fp8 products are held to
    hf_bf16 = teacher_forced_hf(model, ids)
    kv_sim = None
    if any(f.endswith("+kv8") for f in formats):
        # the same model with every K and V rounded to E4M3 at unit scale, as an FP8 cache holds
        # them (transformers rounds before the rotary embedding, rserve after it)
        hooks = [proj.register_forward_hook(lambda _m, _a, y: y.to(torch.float8_e4m3fn).to(y.dtype))
                 for layer in model.model.layers
                 for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        kv_sim = teacher_forced_hf(model, ids)
        for h in hooks:
            h.remove()
        emit(out, {"part": "quant-reference", "model": kind,
                   "transformers_kv_fp8_sim_vs_bf16": compare(kind, hf_bf16, (kv_sim[0], kv_sim[1]))})
    sim = None
    if "fp8" in formats:
        def fake_fp8(x):
            xf = x.float()
            amax = xf.abs().amax(-1, keepdim=True)
            sc = torch.where(amax > 0, (amax / 448.0).clamp(min=torch.finfo(torch.float32).tiny),
                             torch.ones_like(amax))
            return ((xf / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc).to(x.dtype)

        with torch.no_grad():
            for layer in model.model.layers:
                for mod in layer.modules():
                    if isinstance(mod, torch.nn.Linear):
                        mod.weight.copy_(fake_fp8(mod.weight))
                        mod.register_forward_pre_hook(lambda _m, args: (fake_fp8(args[0]),))
        sim = teacher_forced_hf(model, ids)
        emit(out, {"part": "quant-reference", "model": kind,
                   "transformers_fp8_sim_vs_bf16": compare(kind, hf_bf16, (sim[0], sim[1]))})
    del model
    torch.cuda.empty_cache()
    subprocess.run(["sync"])
    c256 = os.environ.get("RSERVE_QUANT_C256", "bf16,fp8").split(",")
    base = None
    for f in formats:
        # FORMAT[+kv8]: --isq FORMAT (bf16: none), and with +kv8 an FP8 KV cache
        weights, _, kv = f.partition("+")
        extra = [] if weights == "bf16" else ["--isq", weights]
        if kv == "kv8":
            extra += ["--kv-cache-dtype", "fp8"]
        elif kv:
            raise SystemExit(f"RSERVE_QUANT: unknown suffix +{kv} in {f} (known: +kv8)")
        extra += shlex.split(os.environ.get(f"RSERVE_QUANT_ARGS_{f.upper()}", ""))
        rec: dict = {"part": "quant", "model": kind, "format": f, "args": extra}
        try:
            srv = Server(a.binary, str(path), a.port, out, "--max-model-len", "9000", *extra, tag=f"-{f}",
                         env={"RUST_LOG": "warn,rserve_core::engine=debug,rserve_core::model_runner=info"})
        except Exception as e:
            rec["error"] = repr(e)[-2000:]
            emit(out, rec)
            continue
        rec["ready_s"] = srv.ready_s
        rec["peak_rss_gb"] = peak_rss_gb(srv.proc.pid)
        try:
            rec["startup"] = startup_lines(srv)
            lp, arg = teacher_forced_rserve(srv, ids)
            rec["vs_transformers_bf16"] = compare(kind, hf_bf16, (lp, arg))
            if f == "fp8" and sim is not None:
                rec["vs_transformers_fp8_sim"] = compare(kind, sim, (lp, arg))
            if f == "bf16+kv8" and kv_sim is not None:
                rec["vs_transformers_kv_fp8_sim"] = compare(kind, kv_sim, (lp, arg))
            if f == "bf16":
                base = (lp, arg)
            elif base is not None:
                errs = [abs(x - y) for x, y in zip(lp, base[0])]
                rec["tf_mean_abs_logprob_err_vs_bf16"] = sum(errs) / len(errs)
                rec["tf_max_abs_logprob_err_vs_bf16"] = max(errs)
                rec["argmax_agree_vs_bf16"] = sum(1 for x, y in zip(arg, base[1]) if x == y) / len(arg)
            b1 = bench(a, srv, out, 1, 4, 512, 256)
            rec["b1_decode_tok_s"] = 1000.0 / b1["tpot_ms"]["median"]
            rec["b1_ttft_ms"] = b1["ttft_ms"]["median"]
            if f in c256:
                c = bench(a, srv, out, 256, 256, 512, 256)
                rec.update(c256_output_tok_s=c["output_throughput"], c256_ttft_ms=c["ttft_ms"]["median"],
                           c256_itl_ms=c["itl_ms"]["median"])
        except Exception as e:  # keep what was measured
            rec["error"] = repr(e)[-2000:]
        finally:
            srv.stop()
        emit(out, rec)
    shutil.rmtree(path, ignore_errors=True)


def make_adapters(base: Path, root: Path, count: int, rank: int = 16) -> list[Path]:
    """`count` PEFT-layout adapters of `rank` on all seven projections of `base` (random bf16)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
            "o_proj": (heads * hd, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    parent = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in dims}
    g = torch.Generator(device="cuda").manual_seed(7)
    dirs = []
    for i in range(count):
        d = root / f"lora-{i}"
        dirs.append(d)
        if (d / "adapter_model.safetensors").exists():
            continue
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for m, (fin, fout) in dims.items():
                key = f"base_model.model.model.layers.{layer}.{parent[m]}.{m}"
                a_ = torch.randn(rank, fin, generator=g, device="cuda") / fin ** 0.5
                b_ = torch.randn(fout, rank, generator=g, device="cuda") * 0.01
                tensors[f"{key}.lora_A.weight"] = a_.to(torch.bfloat16).cpu()
                tensors[f"{key}.lora_B.weight"] = b_.to(torch.bfloat16).cpu()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(dims), "use_rslora": False, "base_model_name_or_path": str(base)}))
    return dirs


def bench_mix(a, srv: Server, names: list[str], conc: int, prompts: int, inp: int, outp: int) -> dict:
    """`rserve bench serve` with requests spread evenly over `names` (adapters or the base)."""
    r = subprocess.run(
        [str(a.binary), "bench", "serve", "--base-url", srv.url + "/v1", "--model", names[0],
         "--lora-modules", ",".join(names), "--num-prompts", str(prompts), "--max-concurrency",
         str(conc), "--random-input-len", str(inp), "--random-output-len", str(outp), "--json"],
        capture_output=True, text=True, timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


STEP_LINE = re.compile(
    r"step \d+: (\d+) seqs, (\d+) tokens, (\d+) decode rows(?:, (\d+) images)?; ([\d.]+) ms since "
    r"the last step, ([\d.]+) ms issue(?: \(of which ([\d.]+) ms prepare\))?, ([\d.]+) ms wait, "
    r"([\d.]+) ms after")


def step_summary(text: str) -> dict:
    """The engine's per-step trace lines (`rserve_core::engine=trace`) summed by kind: steps with
    prompt rows and decode-only steps, their count, mean tokens and mean wall time (the time since
    the step before plus its issue, wait and after), the prompt steps' mean host issue time, and
    the host's idle time between steps (`since`, summed). Where the lines carry them: the images
    each kind of step encoded and its prepare time (the encoder's issue included). A step's issue
    and wait are not its own device time: with async scheduling it is issued while the step
    before runs, and an image step's launches fill the device's queue, so its issue waits for
    the step before; sums over a load are what compare."""
    kinds: dict = {"prompt": [], "decode": []}
    for m in STEP_LINE.finditer(text):
        g = m.groups()
        tokens, decodes = float(g[1]), float(g[2])
        images = float(g[3] or 0)
        since, issue, wait, after = float(g[4]), float(g[5]), float(g[7]), float(g[8])
        prepare = float(g[6] or 0)
        row = (tokens, since + issue + wait + after, issue, since, images, prepare)
        kinds["prompt" if tokens > decodes else "decode"].append(row)
    res: dict = {}
    for kind, rows in kinds.items():
        if rows:
            res[f"{kind}_steps"] = len(rows)
            res[f"{kind}_tokens_mean"] = round(sum(r[0] for r in rows) / len(rows), 1)
            res[f"{kind}_wall_ms_mean"] = round(sum(r[1] for r in rows) / len(rows), 3)
            res[f"{kind}_wall_s"] = round(sum(r[1] for r in rows) / 1e3, 3)
            res[f"{kind}_issue_ms_mean"] = round(sum(r[2] for r in rows) / len(rows), 3)
            res[f"{kind}_idle_s"] = round(sum(r[3] for r in rows) / 1e3, 3)
            res[f"{kind}_images"] = int(sum(r[4] for r in rows))
            res[f"{kind}_prepare_ms_mean"] = round(sum(r[5] for r in rows) / len(rows), 3)
    full = [r for r in kinds["prompt"] if r[0] >= 8000]
    if full:
        res["full_prompt_steps"] = len(full)
        res["full_prompt_wall_ms_mean"] = round(sum(r[1] for r in full) / len(full), 3)
    prompt = kinds["prompt"]
    res["prompt_shapes"] = [[int(r[0]), int(r[4]), round(r[1], 1), round(r[3], 1)] for r in prompt]
    return res


def part_lora(a, out: Path) -> None:
    """Multi-adapter serving on the 8B shape: 64 concurrent 1024 in / 256 out over 1, 8 and 64
    rank-16 adapters (all seven projections) against the base in the same server; batch-1 decode
    with one adapter; loading one adapter at runtime. RSERVE_LORA_ISQ=q4k repeats the mix on an
    ISQ base. RSERVE_LORA_COUNTS (default 1,8,64) picks the mixes. RSERVE_LORA_AB=1 adds a server
    whose prompt chunks stay in the gathered kernels (RSERVE_LORA_MIN_RUN=0): base and one
    adapter, for the run products' share. RSERVE_LORA_FUSED_AB (e.g. 0,2) adds a server for each
    RSERVE_LORA_FUSED value named (decode rows in three or two launches) beside the default one.
    RSERVE_LORA_ENV_AB adds a server per `;`-separated set of VAR=VALUE pairs (`,`-separated; an
    empty set is the default server again), e.g. `RSERVE_LORA_SHRINK_CHUNK=512;;RSERVE_LORA_SHRINK_CHUNK=512`
    for the default and the earlier shrink alternating. `RSERVE_BASELINE_BINARY=path` in a set
    serves that variant with another build; set in the environment, it adds one such server last
    (as the vision check takes it); RSERVE_LORA_AB_QUICK=1 leaves batch 1 and the runtime loads
    to the default server. RSERVE_LORA_TRACE=1 logs every engine step and records each mix's
    steps summed by kind (`step_summary`)."""
    kind = a.big.split(",")[0]
    root = Path(a.scratch)
    _, path = fresh_checkpoint(kind, root)
    counts = [int(c) for c in os.environ.get("RSERVE_LORA_COUNTS", "1,8,64").split(",")]
    t0 = time.time()
    dirs = make_adapters(path, root / "adapters", max(counts) + 1)
    emit(out, {"part": "lora-setup", "adapters": len(dirs), "made_s": time.time() - t0})
    served, extra_dir = dirs[:-1], dirs[-1]
    modules = [f"a{i}={d}" for i, d in enumerate(served)]
    # (isq, prompt rows in the gathered kernels only, RSERVE_LORA_FUSED for decode rows, more env)
    variants = [("", False, "", {})]
    variants += [("", False, v, {}) for v in os.environ.get("RSERVE_LORA_FUSED_AB", "").split(",") if v]
    if os.environ.get("RSERVE_LORA_AB") == "1":
        variants.append(("", True, "", {}))
    if "RSERVE_LORA_ENV_AB" in os.environ:
        for group in os.environ["RSERVE_LORA_ENV_AB"].split(";"):
            variants.append(("", False, "", dict(kv.split("=", 1) for kv in group.split(",") if kv)))
    if os.environ.get("RSERVE_BASELINE_BINARY"):
        variants.append(("", False, "", {"RSERVE_BASELINE_BINARY": os.environ["RSERVE_BASELINE_BINARY"]}))
    variants += [(f, False, "", {}) for f in os.environ.get("RSERVE_LORA_ISQ", "").split(",") if f]
    for n_variant, (isq, gathered_only, launches, more) in enumerate(variants):
        rec: dict = {"part": "lora", "model": kind, "isq": isq or "none", "env": more}
        more = dict(more)
        binary = more.pop("RSERVE_BASELINE_BINARY", a.binary)
        trace = os.environ.get("RSERVE_LORA_TRACE") == "1"
        env = {"RSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1",
               "RUST_LOG": f"warn,rserve_core::engine={'trace' if trace else 'debug'},rserve_core::model_runner=info",
               **more}
        if gathered_only:
            env["RSERVE_LORA_MIN_RUN"] = "0"
            rec["prompt_rows"] = "gathered kernels only"
        if launches:
            env["RSERVE_LORA_FUSED"] = launches
            rec["decode_rows"] = f"RSERVE_LORA_FUSED={launches}"
        args = ["--max-model-len", "4096", "--enable-lora", "--max-loras", str(len(served)),
                "--max-cpu-loras", str(len(served) + 1), "--max-lora-rank", "16",
                "--lora-modules", *modules]
        if isq:
            args += ["--isq", isq]
        try:
            srv = Server(binary, str(path), a.port, out, *args,
                         tag=f"-lora{n_variant}{isq}{'-gathered' if gathered_only else ''}{'-fused' + launches if launches else ''}",
                         env=env)
        except Exception as e:
            rec["error"] = repr(e)[-2000:]
            emit(out, rec)
            continue
        rec["ready_s"] = srv.ready_s
        try:
            lines = srv.log_path.read_text().splitlines()
            rec["startup"] = [ln.strip()[-300:] for ln in lines if "LoRA" in ln or "rserve: serving" in ln][-3:]
            base = srv.model_name()
            mixes = {"base": [base]}
            for c in counts[:1] if gathered_only else counts:
                mixes[f"{c}-adapters"] = [f"a{i}" for i in range(c)]
            runs = {}
            for k, names in mixes.items():
                at = len(srv.log_path.read_text())
                runs[k] = bench_mix(a, srv, names, 64, 128, 1024, 256)
                if trace:
                    rec[f"c64_{k}_steps"] = step_summary(srv.log_path.read_text()[at:])
            for k, r in runs.items():
                rec[f"c64_{k}_output_tok_s"] = r["output_throughput"]
                rec[f"c64_{k}_tpot_ms"] = r["tpot_ms"]["median"]
                rec[f"c64_{k}_ttft_ms"] = r["ttft_ms"]["median"]
                if k != "base":
                    rec[f"c64_{k}_vs_base"] = r["output_throughput"] / runs["base"]["output_throughput"]
            # greedy tokens of four requests at once (a decode batch of mixed adapters and a base
            # row), to compare across the variants
            names = [f"a{i % len(served)}" for i in (0, 1)] + [base, "a0"]
            greedy = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "logprobs": 1}
            with cf.ThreadPoolExecutor(4) as ex:
                done = list(ex.map(lambda m: srv.post("/v1/completions", {"model": m, **greedy}), names))
            rec["greedy"] = [{"model": m, "text": d["choices"][0]["text"],
                              "logprobs": d["choices"][0]["logprobs"]["token_logprobs"]}
                             for m, d in zip(names, done)]
            # RSERVE_LORA_AB_QUICK=1: the environment variants measure the mixes only
            quick = bool(more) and os.environ.get("RSERVE_LORA_AB_QUICK") == "1"
            if not gathered_only and not quick:
                b1b = bench_mix(a, srv, [base], 1, 4, 512, 256)
                b1l = bench_mix(a, srv, ["a0"], 1, 4, 512, 256)
                rec["b1_base_tok_s"] = 1000.0 / b1b["tpot_ms"]["median"]
                rec["b1_adapter_tok_s"] = 1000.0 / b1l["tpot_ms"]["median"]
                rec["b1_adapter_vs_base"] = rec["b1_adapter_tok_s"] / rec["b1_base_tok_s"]
                loads, first, resident = [], [], []
                one = {"prompt": "Hello", "max_tokens": 1}
                for i in range(3):
                    t = time.time()
                    srv.post_text("/v1/load_lora_adapter", {"lora_name": f"rt{i}", "lora_path": str(extra_dir)})
                    loads.append((time.time() - t) * 1000)
                    # the first request of a new adapter writes its slot; a resident one does not
                    t = time.time()
                    srv.post("/v1/completions", {"model": f"rt{i}", **one})
                    first.append((time.time() - t) * 1000)
                    t = time.time()
                    srv.post("/v1/completions", {"model": "a0", **one})
                    resident.append((time.time() - t) * 1000)
                    srv.post_text("/v1/unload_lora_adapter", {"lora_name": f"rt{i}"})
                rec["runtime_load_ms"] = loads
                rec["first_request_new_adapter_ms"] = first
                rec["first_request_resident_adapter_ms"] = resident
            steps = [ln.strip()[-160:] for ln in srv.log_path.read_text().splitlines() if "steps:" in ln]
            rec["steps"] = steps[-6:]
        except Exception as e:  # keep what was measured
            rec["error"] = repr(e)[-2000:]
        finally:
            srv.stop()
        emit(out, rec)


def bench_json(a, srv: Server, *args: str) -> dict:
    """`rserve bench serve` against `srv` with `args`; its JSON report."""
    r = subprocess.run(
        [str(a.binary), "bench", "serve", "--base-url", srv.url + "/v1", "--model", srv.model_name(),
         *args, "--json"],
        capture_output=True, text=True, timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def chat_replay(srv: Server, conversations: int, turns: int, user_len: int, reply_len: int) -> list[dict]:
    """Multi-turn chat replay: `conversations` at once, each turn resending the whole history
    (earlier prompts and the model's own replies, as token ids) plus `user_len` new tokens.
    Per turn: median TTFT and the share of prompt tokens found in the prefix cache."""
    import random
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(0)
    history = [[rng.randrange(20, 900) for _ in range(user_len)] for _ in range(conversations)]
    model = srv.model_name()

    def one(i: int) -> tuple[float, int, int, list[int]]:
        body = {"model": model, "prompt": history[i], "max_tokens": reply_len, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": 0, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, ttft, reply, usage = time.time(), None, [], {}
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for c in ev.get("choices") or []:
                    toks = (c.get("logprobs") or {}).get("tokens") or []
                    if toks and ttft is None:
                        ttft = time.time() - t0
                    reply += [int(t.split(":", 1)[1]) for t in toks]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return ttft or 0.0, len(history[i]), cached, reply

    rows = []
    for turn in range(turns):
        with ThreadPoolExecutor(conversations) as ex:
            res = list(ex.map(one, range(conversations)))
        ttfts = sorted(r[0] for r in res)
        prompt_tokens = sum(r[1] for r in res)
        rows.append({"turn": turn + 1, "prompt_tokens_mean": prompt_tokens / conversations,
                     "ttft_ms_median": ttfts[len(ttfts) // 2] * 1e3,
                     "hit_rate": sum(r[2] for r in res) / max(prompt_tokens, 1)})
        for i, r in enumerate(res):
            history[i] = history[i] + r[3] + [rng.randrange(20, 900) for _ in range(user_len)]
    return rows


def part_prefix(a, out: Path) -> None:
    """Prefix caching on the 8B shape, cache on and off in one call: 0% shared (256 concurrent,
    512 in / 256 out), 8 shared 2,048-token prefixes with 128-token suffixes (128 out, 256
    requests at 64 concurrent), and a multi-turn chat replay (hit rate and TTFT per turn)."""
    kind = a.big.split(",")[0]
    _, path = fresh_checkpoint(kind, Path(a.scratch))
    for label, flags in (("on", []), ("off", ["--no-enable-prefix-caching"])):
        rec: dict = {"part": "prefix", "model": kind, "cache": label}
        try:
            srv = Server(a.binary, str(path), a.port, out, "--max-model-len", "8192", *flags,
                         tag=f"-prefix-{label}")
        except Exception as e:
            rec["error"] = repr(e)[-2000:]
            emit(out, rec)
            continue
        try:
            r = bench_json(a, srv, "--num-prompts", "512", "--max-concurrency", "256",
                           "--random-input-len", "512", "--random-output-len", "256")
            rec["unshared_c256_output_tok_s"] = r["output_throughput"]
            rec["unshared_c256_ttft_ms"] = r["ttft_ms"]["median"]
            r = bench_json(a, srv, "--dataset-name", "prefix_repetition", "--num-prompts", "256",
                           "--max-concurrency", "64", "--prefix-repetition-prefix-len", "2048",
                           "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes",
                           "8", "--prefix-repetition-output-len", "128")
            rec["shared8_output_tok_s"] = r["output_throughput"]
            rec["shared8_ttft_ms"] = r["ttft_ms"]["median"]
            rec["shared8_hit_rate"] = r["prefix_cache_hit_rate"]
            rec["chat_replay"] = chat_replay(srv, 16, 6, 256, 128)
        except Exception as e:  # keep what was measured
            rec["error"] = repr(e)[-2000:]
        finally:
            srv.stop()
        emit(out, rec)


def bytelevel_tokenizer(vocab: int, path: Path) -> None:
    """A byte-level BPE vocabulary of `vocab` tokens (GPT-2's byte alphabet, then merges of random
    pairs of letters, digits, spaces and JSON punctuation), so grammars see a realistic 128k trie
    where the word-level test tokenizer has no punctuation at all."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(0)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab_map = {c: i for i, c in enumerate(alphabet)}
    common = [c for c in alphabet if c.isalnum()] + ["\u0120"] * 8 + list('{}[]":,.-_')
    tokens = list(common)
    merges = []
    while len(vocab_map) < vocab:
        a = rng.choice(tokens)
        b = rng.choice(common)
        s = a + b
        if s in vocab_map or len(s) > 12:
            continue
        vocab_map[s] = len(vocab_map)
        merges.append((a, b))
        tokens.append(s)
    tok = Tokenizer(models.BPE(vocab_map, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


def part_structured(a, out: Path) -> None:
    """Structured output on the 8B shape with a 128k byte-level vocabulary: grammar compile time
    and per-token mask time for a 50-field schema (`rserve bench grammar`), then 64 concurrent
    json_schema requests against the same load unconstrained, on one server, in one call."""
    kind = a.big.split(",")[0]
    _, path = fresh_checkpoint(kind, Path(a.scratch))
    sdir = Path(a.scratch) / f"{kind}-bytelevel"
    sdir.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and not (sdir / f.name).exists():
            (sdir / f.name).symlink_to(f)
    if not (sdir / "tokenizer.json").exists():
        bytelevel_tokenizer(128256, sdir)
    rec: dict = {"part": "structured", "model": kind}
    r = subprocess.run([str(a.binary), "bench", "grammar", str(sdir), "--fields", "50", "--tokens", "512",
                        "--json"], capture_output=True, text=True, timeout=600)
    rec["grammar"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-2000:]
    # no prefix cache: every run sends the same prompts, and later runs would find them cached
    srv = Server(a.binary, str(sdir), a.port, out, "--max-model-len", "4096", "--no-enable-prefix-caching",
                 tag="-structured")
    try:
        common = ["--num-prompts", "256", "--max-concurrency", "64", "--random-input-len", "512",
                  "--random-output-len", "256"]
        # warm-up (graph captures, allocations, the vocabulary index)
        bench_json(a, srv, "--num-prompts", "64", "--max-concurrency", "64", "--random-input-len", "512",
                   "--random-output-len", "64", "--structured-output", "json_schema")
        for label, extra in (("plain", []), ("json_schema", ["--structured-output", "json_schema"]),
                             ("plain_again", [])):
            r = bench_json(a, srv, *common, *extra)
            rec[f"{label}_output_tok_s"] = r["output_throughput"]
            rec[f"{label}_tpot_ms"] = r["tpot_ms"]["median"]
            rec[f"{label}_failed"] = r["failed"]
        with urllib.request.urlopen(srv.url + "/metrics") as resp:
            metrics = resp.read().decode()
        vals = {}
        for line in metrics.splitlines():
            if line.startswith("rserve:structured_output_mask"):
                name, v = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                vals[name] = v
        masks = vals.get("rserve:structured_output_masks_total", 0.0)
        secs = vals.get("rserve:structured_output_mask_seconds_total", 0.0)
        rec["server_masks"] = masks
        rec["server_mask_us_per_row"] = secs / masks * 1e6 if masks else None
        base = (rec["plain_output_tok_s"] + rec["plain_again_output_tok_s"]) / 2
        rec["json_schema_vs_plain"] = rec["json_schema_output_tok_s"] / base
        # a sample of the constrained output, to show it is JSON
        schema = {"type": "object", "properties": {"id": {"type": "integer", "maximum": 1000},
                                                   "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
                  "required": ["id", "ok", "tag"], "additionalProperties": False}
        s = srv.post("/v1/completions", {"model": srv.model_name(), "prompt": [5, 6, 7], "max_tokens": 64,
                                         "temperature": 0, "response_format": {
                                             "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        rec["sample"] = s["choices"][0]["text"][:200]
    except Exception as e:  # keep what was measured
        rec["error"] = repr(e)[-2000:]
    finally:
        srv.stop()
    emit(out, rec)


def part_coldstart(a, out: Path) -> None:
    d = FIXTURES / "models" / "llama3"
    cache = Path(os.environ.get("CUDA_CACHE_PATH", "/tmp/rserve-cuda-cache"))
    for label in ("empty driver cache", "warm driver cache"):
        if label.startswith("empty"):
            shutil.rmtree(cache, ignore_errors=True)
        srv = Server(a.binary, str(d), a.port, out, "--gpu-memory-utilization", "0.3")
        try:
            t0 = time.time()
            srv.post("/v1/completions", {"model": srv.model_name(), "prompt": "Hello", "max_tokens": 1})
            first = time.time() - t0
        finally:
            srv.stop()
        emit(out, {"part": "coldstart", "cache": label, "ready_s": srv.ready_s, "first_request_s": first})


def part_startup(a, out: Path) -> None:
    import gc

    import torch

    models = [None]
    for kind in ("llama-3.2-1b", "llama-3.1-8b"):
        model, path = make_big(kind, Path(a.scratch))
        del model
        gc.collect()
        torch.cuda.empty_cache()
        models.append(path)
    for model in models:
        for label, env in (("jit cache disabled", {"CUDA_CACHE_DISABLE": "1"}),
                           ("jit cache warm", {"CUDA_CACHE_PATH": "/tmp/rserve-startup-cache"})):
            cmd = [str(a.binary), "bench", "startup", *([str(model)] if model else []), "--runs", "2",
                   "--json", "--", "--gpu-memory-utilization", "0.85", *shlex.split(os.environ.get("RSERVE_SERVE_ARGS", ""))]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=400)
            for line in r.stdout.splitlines():
                if line.startswith("{"):
                    emit(out, {"part": "startup", "model": model.name if model else "rserve-tiny",
                               "cache": label, **json.loads(line)})
            if r.returncode:
                emit(out, {"part": "startup", "model": str(model), "cache": label, "error": r.stderr[-2000:]})
    # once with the page cache dropped, where the machine allows it
    r = subprocess.run([str(a.binary), "bench", "startup", str(models[-1]), "--runs", "1", "--cold", "--json",
                        "--", "--gpu-memory-utilization", "0.85"],
                       capture_output=True, text=True, env={**os.environ, "CUDA_CACHE_DISABLE": "1"}, timeout=400)
    emit(out, {"part": "startup-cold", "stdout": r.stdout[-3000:], "stderr": r.stderr[-1000:]})


def part_vision(a, out: Path) -> None:
    from check_vision import part_vision as run

    run(a, out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="coldstart,tiny,batch,big")
    p.add_argument("--big", default="llama-3.1-8b,qwen2.5-7b")
    p.add_argument("--scratch", default="/tmp/rserve-big")
    p.add_argument("--speed", default=os.environ.get("RSERVE_SPEED", "b1,b64,c256,p8k"))
    p.add_argument("--port", type=int, default=8011)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    parts = {"tiny": part_tiny, "batch": part_batch, "big": part_big, "coldstart": part_coldstart,
             "profile": part_profile, "speed": part_speed, "quant": part_quant, "lora": part_lora,
             "prefix": part_prefix, "structured": part_structured, "vision": part_vision,
             "startup": part_startup}
    failed = []
    for name in a.parts.split(","):
        t0 = time.time()
        try:
            parts[name](a, a.out)
        except Exception as e:  # report and go on with the other parts
            failed.append(name)
            emit(a.out, {"part": name, "error": repr(e)[-3000:]})
        log(f"== {name}: {time.time() - t0:.1f}s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
