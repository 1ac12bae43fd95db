#!/usr/bin/env python3
"""CPU throughput of rserve against transformers on the same checkpoint.

Builds (once) a checkpoint with Qwen2.5-0.5B's shape and random weights, measures prefill and
decode throughput with transformers (eager, ``torch.inference_mode()``), then runs
``rserve bench`` on the same directory with the same lengths, and prints a markdown table.
The two engines run one after the other, never at the same time.

Needs torch, transformers and safetensors. Example:

    python benchmarks/cpu_bench.py                       # full shape, float32
    python benchmarks/cpu_bench.py --tiny --skip-rserve  # quick check of the transformers side
    python benchmarks/cpu_bench.py --dtype float32,bfloat16 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "crates" / "core" / "assets" / "tokenizer.json"
DEFAULT_DIR = "/tmp/rserve-bench/qwen2.5-0.5b-shape"
TINY_DIR = "/tmp/rserve-bench/qwen2-tiny"
DTYPES = ("float32", "bfloat16", "float16")

# Qwen2.5-0.5B's config.json, less the tokenizer-specific ids.
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151643,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=32768,
    bos_token_id=998,
    eos_token_id=999,
)
COMMON = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=21,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
)
# Fields of config.json checked against the requested shape before reusing a directory.
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def version(pkg: str) -> str:
    try:
        return _version(pkg)
    except PackageNotFoundError:
        return "n/a"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------


def ensure_checkpoint(model_dir: Path, shape: dict, save_dtype: str, seed: int) -> None:
    cfg_path = model_dir / "config.json"
    weights = list(model_dir.glob("*.safetensors"))
    if cfg_path.exists() and weights:
        have = json.loads(cfg_path.read_text())
        want = {**shape, "tie_word_embeddings": True}
        diff = {k: (have.get(k), want[k]) for k in SHAPE_KEYS if have.get(k) != want[k]}
        saved = have.get("dtype", have.get("torch_dtype"))
        if saved != save_dtype:
            diff["dtype"] = (saved, save_dtype)
        if diff:
            sys.exit(
                f"error: {model_dir} holds a different checkpoint ({diff}, as (found, wanted)); "
                "remove it or pass another --model-dir"
            )
        log(f"reusing checkpoint in {model_dir}")
    else:
        build_checkpoint(model_dir, shape, save_dtype, seed)
    tok = model_dir / "tokenizer.json"
    if not tok.exists():
        if not TOKENIZER.exists():
            sys.exit(f"error: {TOKENIZER} not found (needed as the model's tokenizer.json)")
        shutil.copyfile(TOKENIZER, tok)


def build_checkpoint(model_dir: Path, shape: dict, save_dtype: str, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    log(f"building a random checkpoint ({save_dtype}) in {model_dir}")
    t = time.perf_counter()
    config = Qwen2Config(**shape, **COMMON)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    # Built directly in the save dtype: no float32 copy next to a converted one.
    model = Qwen2ForCausalLM._from_config(config, dtype=torch_dtype(save_dtype))
    model.eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    log(f"saved {n / 1e6:.1f}M parameters in {time.perf_counter() - t:.1f} s")


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def random_ids(gen, batch: int, length: int, vocab: int):
    import torch

    # Same range as rserve bench: skip the lowest ids.
    return torch.randint(20, vocab, (batch, length), generator=gen, dtype=torch.long)


def bench_transformers(model_dir: Path, dtype: str, args) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.torch_threads or cores())
    log(f"transformers: loading {model_dir} as {dtype} (attn {args.attn_implementation})")
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype(dtype), attn_implementation=args.attn_implementation
    )
    model.eval()
    load_s = time.perf_counter() - t
    cfg = model.config
    vocab = cfg.vocab_size
    eos = cfg.eos_token_id
    pad = eos if isinstance(eos, int) else 0
    gen = torch.Generator().manual_seed(args.seed)

    def prefill_once(length: int) -> float:
        ids = random_ids(gen, 1, length, vocab)
        t0 = time.perf_counter()
        # Logits of the last position only, as generate() and rserve do for a prompt.
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    def generate_once(batch: int, new: int) -> float:
        ids = random_ids(gen, batch, args.prompt_len, vocab)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        dt = time.perf_counter() - t0
        if out.shape != (batch, args.prompt_len + new):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}")
        return dt

    res: dict = {
        "engine": "transformers",
        "dtype": dtype,
        "attn_implementation": args.attn_implementation,
        "threads": torch.get_num_threads(),
        "load_s": load_s,
        "loadavg_before": loadavg(),
    }
    with torch.inference_mode():
        log("transformers: warm-up")
        prefill_once(min(args.prefill_len, 64))
        generate_once(1, 4)

        times = []
        for r in range(args.reps):
            times.append(prefill_once(args.prefill_len))
            log(f"transformers: prefill {args.prefill_len} rep {r}: {times[-1]:.3f} s")
        res["prefill_len"] = args.prefill_len
        res["prefill_s"] = times
        res["prefill_tok_s"] = args.prefill_len / median(times)

        res["decode"] = []
        for b in args.batch:
            t1 = [generate_once(b, 1) for _ in range(args.reps)]
            tn = [generate_once(b, args.output_len) for _ in range(args.reps)]
            dt = median(tn) - median(t1)
            tok_s = b * (args.output_len - 1) / dt if dt > 0 else float("nan")
            log(
                f"transformers: batch {b}: t(1)={median(t1):.3f} s t({args.output_len})="
                f"{median(tn):.3f} s -> {tok_s:.1f} tok/s"
            )
            res["decode"].append({"batch": b, "t_first_s": t1, "t_all_s": tn, "tok_s": tok_s})
    res["loadavg_after"] = loadavg()
    res["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    del model
    return res


# ---------------------------------------------------------------------------------------------
# rserve
# ---------------------------------------------------------------------------------------------


def bench_rserve(model_dir: Path, dtype: str, args) -> dict:
    binary = Path(args.rserve)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise FileNotFoundError(
            f"rserve binary not found or not executable: {binary} "
            "(build it with `cargo build --release -p rserve-server`, pass --rserve PATH, "
            "or use --skip-rserve)"
        )
    cmd = [
        str(binary),
        "bench",
        str(model_dir),
        "--json",
        "--dtype",
        dtype,
        "--prefill-len",
        str(args.prefill_len),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--batch",
        ",".join(map(str, args.batch)),
        "--reps",
        str(args.reps),
        *args.rserve_arg,
    ]
    log("rserve: " + " ".join(cmd))
    before = loadavg()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(
            f"rserve bench exited with {p.returncode}\n--- stderr ---\n{p.stderr.strip()}"
            f"\n--- stdout ---\n{p.stdout.strip()}"
        )
    lines = [ln for ln in p.stdout.splitlines() if ln.lstrip().startswith("{")]
    if not lines:
        raise RuntimeError(f"rserve bench printed no JSON line:\n{p.stdout}\n{p.stderr}")
    res = json.loads(lines[-1])
    res.update(
        engine="rserve",
        command=cmd,
        wall_s=wall,
        loadavg_before=before,
        loadavg_after=loadavg(),
    )
    log(f"rserve: done in {wall:.1f} s")
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(x) -> str:
    if x is None:
        return "–"
    if x != x:  # NaN
        return "nan"
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def ratio(a, b) -> str:
    if a is None or b is None or not b or a != a or b != b:
        return "–"
    return f"{a / b:.2f}x"


def table(dtype: str, hf: dict | None, rs: dict | None, args, env: dict) -> str:
    hf_threads = hf["threads"] if hf else "–"
    rs_threads = rs.get("threads", "–") if rs else "–"
    head = (
        f"{env['date']} · {env['cpu']} · {env['cores']} cores · torch {env['torch']} · "
        f"transformers {env['transformers']} · dtype {dtype} · threads: torch {hf_threads}, "
        f"rserve {rs_threads} · attn {args.attn_implementation} · model {env['model']}"
    )
    if env.get("omp_wait_policy"):
        head += f" · OMP_WAIT_POLICY={env['omp_wait_policy']}"

    def dec(res, b):
        if not res:
            return None
        return next((d["tok_s"] for d in res["decode"] if d["batch"] == b), None)

    rows = [
        (
            f"prefill {args.prefill_len} tok/s",
            hf["prefill_tok_s"] if hf else None,
            rs["prefill_tok_s"] if rs else None,
        )
    ]
    for b in args.batch:
        rows.append((f"decode batch {b} tok/s", dec(hf, b), dec(rs, b)))
    out = [head, "", "| | transformers eager | rserve | ratio (rserve / transformers) |"]
    out.append("|---|---:|---:|---:|")
    for name, a, b in rows:
        out.append(f"| {name} | {fmt(a)} | {fmt(b)} | {ratio(b, a)} |")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help=f"checkpoint directory (default {DEFAULT_DIR})")
    p.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 1000 (smoke test)")
    p.add_argument("--save-dtype", default="float32", choices=DTYPES, help="dtype of the checkpoint")
    p.add_argument(
        "--dtype", default="float32", help="dtype(s) to run, comma-separated (float32,bfloat16)"
    )
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads", type=int, default=0, help="torch threads (default: all cores)"
    )
    p.add_argument("--attn-implementation", default="eager", help="transformers attention")
    p.add_argument("--rserve", default=str(REPO / "target" / "release" / "rserve"))
    p.add_argument(
        "--rserve-arg",
        action="append",
        default=[],
        help="extra argument for `rserve bench` (repeatable, e.g. --rserve-arg=--max-num-seqs=8)",
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-rserve", action="store_true")
    p.add_argument("--out", help="write the raw results as JSON here")
    a = p.parse_args(argv)
    a.batch = [int(x) for x in a.batch.split(",") if x]
    a.dtype = [x.strip() for x in a.dtype.split(",") if x.strip()]
    for d in a.dtype:
        if d not in DTYPES:
            p.error(f"unknown --dtype {d!r} (one of {', '.join(DTYPES)})")
    if a.output_len < 2:
        p.error("--output-len must be at least 2")
    if a.reps < 1:
        p.error("--reps must be at least 1")
    if a.model_dir is None:
        a.model_dir = TINY_DIR if a.tiny else DEFAULT_DIR
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.skip_rserve and not (
        Path(args.rserve).is_file() and os.access(args.rserve, os.X_OK)
    ):
        # Fail before spending minutes on transformers.
        sys.exit(
            f"error: rserve binary not found or not executable: {args.rserve}\n"
            "build it with `cargo build --release -p rserve-server`, pass --rserve PATH, "
            "or use --skip-rserve"
        )
    model_dir = Path(args.model_dir)
    ensure_checkpoint(model_dir, TINY if args.tiny else QWEN25_05B, args.save_dtype, args.seed)

    env = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": cores(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "model": "tiny" if args.tiny else "Qwen2.5-0.5B shape",
        "model_dir": str(model_dir),
        "loadavg_start": loadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    results = {"env": env, "args": {k: v for k, v in vars(args).items()}, "runs": []}
    tables = []
    failed = False
    for dtype in args.dtype:
        hf = rs = None
        if not args.skip_transformers:
            hf = bench_transformers(model_dir, dtype, args)
        if not args.skip_rserve:
            try:
                rs = bench_rserve(model_dir, dtype, args)
            except (RuntimeError, OSError, json.JSONDecodeError) as e:
                log(f"rserve failed: {e}")
                results.setdefault("errors", []).append({"dtype": dtype, "rserve": str(e)})
                failed = True
        results["runs"].append({"dtype": dtype, "transformers": hf, "rserve": rs})
        tables.append(table(dtype, hf, rs, args, env))
    env["loadavg_end"] = loadavg()

    print("\n\n".join(tables))
    print(f"\nload average (1/5/15 min): start {env['loadavg_start']}, end {env['loadavg_end']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
