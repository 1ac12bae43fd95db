"""`rserve serve --isq FORMAT`, `--kv-cache-dtype fp8` and GGUF files. With --isq the server
quantizes the decoder's projections while loading, says so on its startup line (format, sizes,
time, tensors that fell back), and serves; an unknown format stops it with the list of known ones.
With --kv-cache-dtype fp8 its startup line gives the cache's tokens in fp8_e4m3. A GGUF file serves with
the template from its metadata and says how its tensors are stored; a truncated one stops the
server naming the file and the tensor."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from support.rserve_process import RserveProcess, binary_path, free_port, startup_timeout

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "tests" / "fixtures" / "models" / "qwen2"


def serve_one_completion(tmp_path: Path, name: str, *extra: str) -> str:
    """Serves the fixture with `extra` flags, asks for one completion, returns the server's log."""
    srv = RserveProcess(
        name,
        [str(binary_path())],
        MODEL,
        tmp_path,
        served_model_name="tiny",
        max_model_len=256,
        extra_args=list(extra),
    )
    srv.start(startup_timeout())
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()
    return srv.log_tail()


def test_isq_serves_and_reports_on_its_startup_line(tmp_path: Path) -> None:
    log = serve_one_completion(tmp_path, "isq", "--isq", "q4k")
    # the fixture's rows of 64 and 128 values do not fit q4k's 256-value blocks: q5_0 instead
    assert "ISQ q4k" in log and "kept as q5_0" in log, log


def test_vllms_quantization_fp8_flag_serves_fp8_weights(tmp_path: Path) -> None:
    log = serve_one_completion(tmp_path, "fp8", "--quantization", "fp8")
    # every projection fits (no blocks); on the CPU the startup line says how products run
    assert "ISQ fp8: 8 projections" in log and "products: on the CPU" in log, log


def refused(*extra: str) -> str:
    args = [str(binary_path()), "serve", str(MODEL), "--port", str(free_port()), *extra]
    done = subprocess.run(args, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode != 0, out
    return out


def test_unknown_isq_format_is_refused() -> None:
    out = refused("--isq", "int3")
    assert "int3" in out and "q4k" in out and "fp8" in out, out


def test_quantization_takes_fp8_only_and_must_agree_with_isq() -> None:
    out = refused("--quantization", "awq")
    assert "awq" in out and "fp8" in out, out
    out = refused("--quantization", "fp8", "--isq", "q8_0")
    assert "disagree" in out, out


def test_kv_cache_dtype_fp8_serves_from_an_fp8_cache(tmp_path: Path) -> None:
    log = serve_one_completion(tmp_path, "kv-fp8", "--kv-cache-dtype", "fp8")
    assert "tokens in fp8_e4m3" in log, log


def test_unknown_kv_cache_dtype_is_refused() -> None:
    out = refused("--kv-cache-dtype", "int8")
    assert "int8" in out and "fp8" in out, out
    out = refused("--kv-cache-dtype", "fp8_e5m2")
    assert "not supported" in out, out


GGUF = REPO / "tests" / "fixtures" / "gguf"


def test_a_gguf_file_serves_chat_with_its_metadata_template(tmp_path: Path) -> None:
    srv = RserveProcess(
        "gguf",
        [str(binary_path())],
        GGUF / "llama-q4_k_m.gguf",
        tmp_path,
        served_model_name="tiny-gguf",
        max_model_len=256,
        extra_args=["--isq-lm-head", "--isq", "q8_0"],
    )
    srv.start(startup_timeout())
    try:
        body = {
            "model": "tiny-gguf",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # the Llama 3 template from the metadata wraps the message in header tokens
        assert r.json()["usage"]["prompt_tokens"] > 8
    finally:
        srv.stop()
    log = srv.log_tail()
    assert "GGUF tensors stored as" in log and "q4k" in log and "q6k" in log, log


def test_a_broken_gguf_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    data = (GGUF / "qwen2-q8_0.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    args = [str(binary_path()), "serve", str(cut), "--port", str(free_port())]
    done = subprocess.run(args, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode != 0, out
    assert "cut.gguf" in out and "ends inside tensor" in out, out


def test_tensor_parallel_flags_refuse_clearly_where_they_cannot_run() -> None:
    # vLLM's spellings all reach the same setting; this machine's build or GPUs cannot take 2 ranks
    for flags in (["--tensor-parallel-size", "2"], ["-tp", "2"], ["-tp=2"], ["--tp", "2"]):
        out = refused(*flags, "--device", "cpu")
        assert "tensor parallelism runs on CUDA GPUs" in out, (flags, out)
    out = refused("-tp", "8")
    assert "4 attention heads do not split over 8 GPUs" in out, out
