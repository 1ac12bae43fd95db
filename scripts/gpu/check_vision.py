"""The `vision` part of scripts/gpu/check.py: Qwen2.5-VL-7B's shape (Qwen2-VL-7B's with
RSERVE_VISION_ARCH=qwen2-vl) with random bf16 weights made here, served by rserve next to
transformers on the same GPU.

- parity: teacher-forced log-probs of a chat prompt with one 448x448 image (ids from rserve's
  /tokenize, pixels from transformers' processor) against transformers bf16.
- TTFT of one 1024x1024 image + 32 text tokens (rserve streamed; transformers: processor + generate
  of one token), and the encoder's share (the same prompt length as text only).
- 64 concurrent requests, one distinct 512x512 image + 64 words each, 128 out: output tok/s
  next to the same load as text-only prompts of the same length.
- decode speed of one request with an image against text-only at the same length.
- `rserve bench vision` (host and encoder time, the encoder's breakdown) with the segment attention
  kernel, without it, and with an earlier build named by RSERVE_BASELINE_BINARY.
RSERVE_VISION_QUICK=1 stops after rserve's TTFT (no transformers TTFT, load or decode steps).
RSERVE_VISION_C64_ONLY=1: the encoder benchmark (this build), the 64-concurrent load and the
decode step only (with RSERVE_BASELINE_BINARY: this build's server, the baseline's, this one's
again, each with its start's memory profile line).
RSERVE_VISION_C64_CLIENTS picks the load's client per round (`rserve`, the default: `rserve bench
serve` with vLLM's `random-mm` dataset; `python`: this script's threads), e.g. `rserve,python`.
RSERVE_VISION_TRACE=1 logs every engine step and sums each load's steps by kind.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import struct
import time
import urllib.request
import zlib
from pathlib import Path

IMAGE = 151655
VISION_START = 151652
VISION_END = 151653
VOCAB = 152064

# words of the word-level tokenizer: t<id>; an image part is its three special tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{% if p.type == 'image' %}"
    f"t{VISION_START} t{IMAGE} t{VISION_END} "
    "{% elif p.type == 'text' %}{{ p.text }} {% endif %}{% endfor %}{% endif %}t4 {% endfor %}"
    "{% if add_generation_prompt %}t5 {% endif %}"
)


def png(width: int, height: int, seed: int) -> bytes:
    """A noisy gradient image as PNG (no imaging library needed)."""
    rng = random.Random(seed)
    rows = []
    for y in range(height):
        row = bytearray([0])
        for x in range(width):
            base = (x * 255 // max(width - 1, 1) + y * 97 // max(height - 1, 1)) & 0xFF
            row += bytes(((base + rng.randrange(64)) & 0xFF, (base * 3 + rng.randrange(64)) & 0xFF,
                          (255 - base + rng.randrange(64)) & 0xFF))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"".join(rows), 1))
            + chunk(b"IEND", b""))


def data_uri(b: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(b).decode()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(1000, 100000)}" for _ in range(n))


def make_vl(root: Path, arch: str = "qwen2.5-vl"):
    """Random bf16 weights in the 7B shape of `arch` (`qwen2.5-vl` or `qwen2-vl`), saved under
    `root`: (transformers' model on the GPU, its path, seconds taken)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from check import word_tokenizer

    path = root / f"{arch}-7b"
    text = dict(vocab_size=VOCAB, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
                rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
    ids = dict(image_token_id=IMAGE, video_token_id=151656, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)
    config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    if arch == "qwen2-vl":
        # Qwen2-VL-7B: full attention in every block, LayerNorm and a QuickGELU MLP
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16,
                      in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      hidden_act="quick_gelu")
    elif arch != "qwen2.5-vl":
        raise SystemExit(f"RSERVE_VISION_ARCH: unknown {arch} (qwen2.5-vl or qwen2-vl)")
    try:
        cfg = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    except TypeError:
        cfg = config_cls(**text, vision_config=vision, tie_word_embeddings=False, **ids)
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_cls(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    word_tokenizer(VOCAB, path)
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return model, path, time.time() - t0


def hf_processor():
    """Transformers' Qwen2-VL image processor with Pillow's resize (what rserve reproduces)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056)


def chat_body(model: str, image: bytes | None, text: str, **kw) -> dict:
    parts = ([{"type": "image_url", "image_url": {"url": data_uri(image)}}] if image else [])
    parts.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": parts}], **kw}


def stream(srv, path: str, body: dict) -> dict:
    """A streamed request: seconds to the first token, arrival time of every chunk with text."""
    req = urllib.request.Request(srv.url + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                if piece:
                    times.append(time.time() - t0)
    return {"ttft": times[0] if times else None, "times": times}


def decode_tok_s(times: list[float]) -> float:
    return (len(times) - 1) / max(times[-1] - times[0], 1e-9) if len(times) > 1 else 0.0


def load(srv, bodies: list[tuple[str, dict]], conc: int) -> dict:
    t0 = time.time()
    with cf.ThreadPoolExecutor(conc) as ex:
        outs = list(ex.map(lambda pb: srv.post(pb[0], pb[1]), bodies))
    wall = time.time() - t0
    done = sum(o["usage"]["completion_tokens"] for o in outs)
    return {"requests": len(outs), "wall_s": wall, "output_tok_s": done / wall,
            "prompt_tokens": outs[0]["usage"]["prompt_tokens"]}


def part_vision(a, out: Path) -> None:
    import torch

    from check import Server, compare, emit, log

    root = Path(a.scratch)
    root.mkdir(parents=True, exist_ok=True)
    arch = os.environ.get("RSERVE_VISION_ARCH", "qwen2.5-vl")
    name = f"{arch}-7b"
    model, path, made = make_vl(root, arch)
    log(f"{name}: made and saved in {made:.1f}s")
    trace_env = ({"RUST_LOG": "warn,rserve_core::engine=trace"}
                 if os.environ.get("RSERVE_VISION_TRACE") == "1" else None)
    # the cost of an image alone: host decode + preprocessing, the encoder (with a breakdown); the
    # same with the encoders' attention through candle ops, and with RSERVE_BASELINE_BINARY (an
    # earlier build) when it is set
    import subprocess

    # RSERVE_VISION_QUICK=1: the default build's benchmark, parity and rserve's TTFT only
    quick = os.environ.get("RSERVE_VISION_QUICK") == "1"
    c64_only = os.environ.get("RSERVE_VISION_C64_ONLY") == "1"
    runs = [("default", a.binary, {})]
    if not (quick or c64_only):
        runs.append(("no-segment-kernel", a.binary, {"RSERVE_SEGMENT_KERNEL": "0"}))
    if os.environ.get("RSERVE_BASELINE_BINARY"):
        runs.append(("baseline", Path(os.environ["RSERVE_BASELINE_BINARY"]), {}))
    for variant, binary, env in runs:
        r = subprocess.run([str(binary), "bench", "vision", str(path), "--device", "cuda", "--json",
                            "--gpu-memory-utilization", "0.5", "--max-model-len", "8192"],
                           capture_output=True, text=True,
                           env={**os.environ, **env, "RSERVE_VISION_PROFILE": "1", "RUST_LOG": "info"})
        bench = next((json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")),
                     {"error": r.stderr[-2000:]})
        profile = [ln[-300:] for ln in r.stderr.splitlines() if "vision encoder" in ln]
        emit(out, {"part": "vision-bench", "model": name, "variant": variant, **bench,
                   "encoder_profile": profile[-4:]})
    if c64_only:
        # the encoder benchmark, then the 64-concurrent load alone (rounds of
        # RSERVE_VISION_C64_CLIENTS) and decode; with RSERVE_BASELINE_BINARY, its server next and
        # this build's again
        del model
        torch.cuda.empty_cache()
        servers = [("default", a.binary)]
        if os.environ.get("RSERVE_BASELINE_BINARY"):
            servers += [("baseline", Path(os.environ["RSERVE_BASELINE_BINARY"])), ("default-again", a.binary)]
        # the start's memory line (info) beside the step trace when asked for
        # RSERVE_VISION_LOG adds directives (e.g. `,rserve_kernels::cublaslt=debug`: each
        # cuBLASLt plan made, summed per load by `c64`)
        log_env = {"RUST_LOG": (trace_env or {}).get("RUST_LOG", "warn") + ",rserve_core::engine::kv_sizing=info"
                   + os.environ.get("RSERVE_VISION_LOG", "")}
        for variant, binary in servers:
            try:
                srv = Server(binary, str(path), a.port, out, "--max-model-len", "8192",
                             "--gpu-memory-utilization", "0.6", tag=f"-vision-{variant}", env=log_env)
            except Exception as e:
                emit(out, {"part": "vision", "variant": variant, "error": repr(e)[-2000:]})
                continue
            rec = {"part": "vision", "model": name, "variant": variant, "ready_s": srv.ready_s,
                   "memory": [ln.strip()[-400:] for ln in srv.log_path.read_text().splitlines()
                              if "GPU memory:" in ln]}
            try:
                c64_rounds(a, srv, srv.model_name(), rec, out)
            except Exception as e:  # keep what was measured
                rec["error"] = repr(e)[-2000:]
            finally:
                srv.stop()
            emit(out, rec)
        return
    proc = hf_processor()
    srv = Server(a.binary, str(path), a.port, out, "--max-model-len", "8192",
                 "--gpu-memory-utilization", "0.6", tag="-vision", env=trace_env)
    rec: dict = {"part": "vision", "model": name, "ready_s": srv.ready_s}
    try:
        m = srv.model_name()
        # parity: one 448x448 image in a chat prompt, teacher-forced
        img = png(448, 448, 1)
        body = chat_body(m, img, words(24, 1))
        ids = srv.post("/tokenize", {"model": m, "messages": body["messages"]})["tokens"]
        r = srv.post("/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 1})
        plp = r["prompt_logprobs"]
        rs_lp = [float(next(v["logprob"] for k, v in p.items() if int(k) == t))
                 for p, t in zip(plp[1:], ids[1:])]
        rs_arg = [int(max(p.items(), key=lambda kv: kv[1]["logprob"])[0]) for p in plp[1:]]
        from PIL import Image
        import io

        px = proc(images=[Image.open(io.BytesIO(img))], return_tensors="pt")
        x = torch.tensor([ids], device="cuda")
        types = (x == IMAGE).int()
        with torch.no_grad():
            kw = dict(input_ids=x, pixel_values=px["pixel_values"].cuda(), image_grid_thw=px["image_grid_thw"].cuda())
            try:
                logits = model(**kw, mm_token_type_ids=types).logits[0].float()
            except TypeError:
                logits = model(**kw).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        tgt = torch.tensor(ids[1:], device="cuda")
        hf_lp = lp[:-1].gather(1, tgt[:, None])[:, 0].tolist()
        top2 = torch.topk(logits[:-1], 2, dim=-1)
        hf = (hf_lp, top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist())
        rec["parity"] = compare(name, hf, (rs_lp, rs_arg))
        rec["parity"]["image_tokens"] = int(types.sum())
        emit(out, {**rec, "step": "parity"})

        # TTFT: one 1024x1024 image + 32 text tokens; warm-up first
        stream(srv, "/v1/chat/completions", chat_body(m, png(1024, 1024, 99), words(32, 99), max_tokens=1))
        ttfts = [stream(srv, "/v1/chat/completions",
                        chat_body(m, png(1024, 1024, 100 + i), words(32, 100 + i), max_tokens=1))["ttft"]
                 for i in range(5)]
        n_img = srv.post("/tokenize", {"model": m, "messages": chat_body(m, png(1024, 1024, 5), words(32, 5))["messages"]})["tokens"]
        text_ids = [random.Random(i).randrange(1000, 100000) for i in range(len(n_img))]
        text_ttfts = [stream(srv, "/v1/completions", {"model": m, "prompt": [7 + i] + text_ids[1:], "max_tokens": 1})["ttft"]
                      for i in range(5)]
        rec["ttft_1024_s"] = sorted(ttfts)[2]
        rec["ttft_text_same_len_s"] = sorted(text_ttfts)[2]
        rec["prompt_tokens_1024"] = len(n_img)
        if quick:
            emit(out, {**rec, "step": "ttft"})
            return
        # transformers: processor + generate of one token, same image size
        hf_times, hf_pre = [], []
        for i in range(4):
            from PIL import Image as _I

            t0 = time.time()
            pil = _I.open(io.BytesIO(png(1024, 1024, 200 + i)))
            px = proc(images=[pil], return_tensors="pt")
            pre = time.time() - t0
            x = torch.tensor([n_img], device="cuda")
            kw = dict(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=px["pixel_values"].cuda(),
                      image_grid_thw=px["image_grid_thw"].cuda(), max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            t1 = time.time()
            with torch.no_grad():
                try:
                    model.generate(**kw, mm_token_type_ids=(x == IMAGE).int())
                except (TypeError, ValueError):
                    model.generate(**kw)
            torch.cuda.synchronize()
            if i:  # the first is a warm-up
                hf_times.append(time.time() - t1 + pre)
                hf_pre.append(pre)
        rec["hf_ttft_1024_s"] = sorted(hf_times)[len(hf_times) // 2]
        rec["hf_preprocess_1024_s"] = sorted(hf_pre)[len(hf_pre) // 2]
        rec["ttft_speedup_vs_hf"] = rec["hf_ttft_1024_s"] / rec["ttft_1024_s"]
        emit(out, {**rec, "step": "ttft"})
        del model
        torch.cuda.empty_cache()

        c64_rounds(a, srv, m, rec, out)
    except Exception as e:  # keep what was measured
        rec["error"] = repr(e)[-2000:]
    finally:
        srv.stop()
    emit(out, rec)
    # the 64-concurrent pair again with the earlier build, then with this one, on the same GPU
    if os.environ.get("RSERVE_BASELINE_BINARY") and not quick:
        for variant, binary in [("baseline", Path(os.environ["RSERVE_BASELINE_BINARY"])),
                                ("default-again", a.binary)]:
            ab: dict = {"part": "vision-c64-ab", "model": name, "variant": variant}
            try:
                srv = Server(binary, str(path), a.port, out, "--max-model-len", "8192",
                             "--gpu-memory-utilization", "0.6", tag=f"-vision-{variant}")
            except Exception as e:
                emit(out, {**ab, "error": repr(e)[-2000:]})
                continue
            try:
                ab.update(c64(a, srv, srv.model_name()))
            except Exception as e:
                ab["error"] = repr(e)[-2000:]
            finally:
                srv.stop()
            emit(out, ab)


def c64_rounds(a, srv, m: str, rec: dict, out: Path) -> None:
    """`c64` once per client of RSERVE_VISION_C64_CLIENTS (default `rserve`; e.g.
    `rserve,python,rserve,python` for the two clients alternating on one server), the first
    round's figures at the top of `rec`; then the decode speed of one image request against
    text-only of the same length."""
    from check import emit

    clients = os.environ.get("RSERVE_VISION_C64_CLIENTS", "rserve").split(",")
    rounds = []
    for i, client in enumerate(clients):
        r = c64(a, srv, m, client, seed=i)
        rounds.append(r)
        if i == 0:
            rec.update(r)
        emit(out, {"part": "vision-c64-round", "variant": rec.get("variant"), "round": i, **r})
    rec["c64_rounds"] = [{"client": r["client"], "ratio": r["c64_image_vs_text"]} for r in rounds]
    n = rec["c64_image"]["prompt_tokens"]
    rng = random.Random(3)
    # decode speed at batch 1: an image request against text-only of the same length
    s_img = stream(srv, "/v1/chat/completions",
                   chat_body(m, png(512, 512, 7), words(64, 7), max_tokens=256, ignore_eos=True, temperature=0))
    s_txt = stream(srv, "/v1/completions", {"model": m, "prompt": [rng.randrange(1000, 100000) for _ in range(n)],
                                            "max_tokens": 256, "ignore_eos": True, "temperature": 0})
    rec["decode_image_tok_s"] = decode_tok_s(s_img["times"])
    rec["decode_text_tok_s"] = decode_tok_s(s_txt["times"])
    rec["decode_image_vs_text"] = rec["decode_image_tok_s"] / max(rec["decode_text_tok_s"], 1e-9)


def bench_serve(a, srv, m: str, *args: str) -> dict:
    """`rserve bench serve` against the server (a Rust client: bodies built before the clock starts
    and sent from many threads, so a megabyte of base64 per request costs the load nothing)."""
    import subprocess

    r = subprocess.run([str(a.binary), "bench", "serve", "--base-url", srv.url + "/v1", "--model", m,
                        "--json", *args], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def c64(a, srv, m: str, client: str = "rserve", seed: int = 0) -> dict:
    """64 concurrent requests, one distinct 512x512 image + 64 words each, 128 out, then the same
    load as text-only prompts of the same length. `client` "rserve" sends them with `rserve bench
    serve` (`random-mm`, then `random` at the image run's prompt length); "python" with the
    earlier client of this script (threads that serialize each body as they send it). With
    RSERVE_VISION_TRACE=1 (a server logging every step) each load's steps are summed by kind.
    Each `seed` draws other images and prompts, so a later round on the same server finds none of
    an earlier one's in the prefix cache."""
    from check import step_summary

    if client == "python":
        return c64_python(srv, m, seed)
    trace = os.environ.get("RSERVE_VISION_TRACE") == "1"
    mm = ["--dataset-name", "random-mm", "--random-mm-base-items-per-request", "1",
          "--random-mm-bucket-config", "{(512, 512, 1): 1.0}", "--random-input-len", "64",
          "--random-output-len", "128", "--max-concurrency", "64"]
    # the warm-up's images and prompts are the next seed's, which no round uses
    bench_serve(a, srv, m, *mm, "--num-prompts", "8", "--seed", str(1000 + seed))
    at = len(srv.log_path.read_text())
    prompts = 128
    img = bench_serve(a, srv, m, *mm, "--num-prompts", str(prompts), "--seed", str(seed))
    mid = len(srv.log_path.read_text())
    n = round(img["prompt_tokens_mean"])
    text = bench_serve(a, srv, m, "--random-input-len", str(n), "--random-output-len", "128",
                       "--num-prompts", str(prompts), "--max-concurrency", "64",
                       "--token-id-min", "1000", "--token-id-max", "100000", "--seed", str(seed))
    keep = ("duration_s", "output_throughput", "prompt_tokens_mean", "ttft_ms", "tpot_ms", "failed")
    res = {"client": "rserve",
           "c64_image": {"prompt_tokens": n, **{k: img[k] for k in keep}},
           "c64_text_same_len": {k: text[k] for k in keep},
           "c64_image_vs_text": img["output_throughput"] / text["output_throughput"],
           # what an image adds to the load's wall time (the same prompts and outputs otherwise)
           "c64_ms_per_image": round(1e3 * (img["duration_s"] - text["duration_s"]) / prompts, 3)}
    log_text = srv.log_path.read_text()
    if trace:
        res["c64_image_steps"] = step_summary(log_text[at:mid])
        res["c64_text_steps"] = step_summary(log_text[mid:])
    for k, part in (("image", log_text[at:mid]), ("text", log_text[mid:])):
        plans = [int(x) for x in re.findall(r"cuBLASLt plan .* in (\d+) us", part)]
        if plans:
            res[f"c64_{k}_lt_plans"] = {"count": len(plans), "ms": round(sum(plans) / 1e3, 2)}
    return res


def c64_python(srv, m: str, seed: int = 0) -> dict:
    """The load of `c64` from this script's own threads (the client of the earlier figures)."""
    base = 1000 + 1000 * seed
    bodies = [("/v1/chat/completions", chat_body(m, png(512, 512, base + i), words(64, base + i),
                                                 max_tokens=128, ignore_eos=True, temperature=0))
              for i in range(136)]
    load(srv, bodies[128:], 8)  # warm-up, images of its own
    img_load = load(srv, bodies[:128], 64)
    n = img_load["prompt_tokens"]
    rng = random.Random(3 + seed)
    text_bodies = [("/v1/completions", {"model": m, "prompt": [rng.randrange(1000, 100000) for _ in range(n)],
                                        "max_tokens": 128, "ignore_eos": True, "temperature": 0})
                   for _ in range(128)]
    text_load = load(srv, text_bodies, 64)
    return {"client": "python", "c64_image": img_load, "c64_text_same_len": text_load,
            "c64_image_vs_text": img_load["output_tok_s"] / text_load["output_tok_s"]}
