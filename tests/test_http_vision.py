"""Images over the OpenAI API (tiny Qwen2.5-VL fixture, goldens from transformers): `image_url`
content parts as data: URIs and file:// URLs, streamed and not, the tokens and usage equal to the
processor's and the model's; /tokenize counts image tokens; every bad image is a 400 in OpenAI's
shape and the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import json
import struct
import subprocess
import threading
import time
import zlib

import httpx
import openai
import pytest
from openai import OpenAI

from conftest import REPO_ROOT
from support.rserve_process import RserveProcess, binary_path, running

VL_DIR = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2_5_vl"
VISION = REPO_ROOT / "tests" / "fixtures" / "vision"
GOLDEN = json.loads((REPO_ROOT / "tests" / "fixtures" / "goldens" / "qwen2_5_vl.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> RserveProcess:
    srv = RserveProcess(
        "vision",
        [str(binary_path())],
        VL_DIR,
        tmp_path_factory.mktemp("rserve-vision"),
        served_model_name="tiny-vl",
        max_model_len=512,
        extra_args=[
            "--limit-mm-per-prompt",
            "image=2",
            "--allowed-local-media-path",
            str(VISION),
            "--media-fetch-timeout",
            "1",
        ],
    )
    yield from running(srv)


@pytest.fixture(scope="module")
def vclient(vl) -> OpenAI:
    return OpenAI(base_url=f"{vl.url}/v1", api_key="none", max_retries=0, timeout=60)


def data_uri(name: str) -> str:
    b64 = base64.b64encode((VISION / f"{name}.png").read_bytes()).decode()
    return f"data:image/png;base64,{b64}"


def messages(case: dict, urls: list[str] | None = None) -> list[dict]:
    urls = urls if urls is not None else [data_uri(n) for n in case["images"]]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": case["text"]})
    return [{"role": "user", "content": parts}]


def token_ids(logprobs) -> list[int]:
    return [int(t.token.split(":", 1)[1]) for t in logprobs.content]


@pytest.mark.parametrize("name", ["one_image", "two_images", "wide_image"])
def test_greedy_tokens_and_usage_match_transformers(vclient, name):
    case = CASES[name]
    r = vclient.chat.completions.create(
        model="tiny-vl",
        messages=messages(case),
        max_tokens=len(case["tokens"]),
        temperature=0,
        logprobs=True,
        extra_body=EXTRA,
    )
    assert token_ids(r.choices[0].logprobs) == case["tokens"]
    assert r.usage.prompt_tokens == len(case["input_ids"])
    assert r.usage.completion_tokens == len(case["tokens"])
    # the same streamed
    chunks = vclient.chat.completions.create(
        model="tiny-vl",
        messages=messages(case),
        max_tokens=len(case["tokens"]),
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
    )
    text, usage = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
        if c.usage:
            usage = c.usage
    assert text == r.choices[0].message.content
    assert usage is not None and usage.prompt_tokens == len(case["input_ids"])


def test_file_urls_under_the_allowed_path(vclient):
    case = CASES["one_image"]
    url = f"file://{VISION / 'rgb_50x70.png'}"
    r = vclient.chat.completions.create(
        model="tiny-vl",
        messages=messages(case, [url]),
        max_tokens=len(case["tokens"]),
        temperature=0,
        logprobs=True,
        extra_body=EXTRA,
    )
    assert token_ids(r.choices[0].logprobs) == case["tokens"]


def test_tokenize_counts_image_tokens(vl):
    case = CASES["two_images"]
    r = httpx.post(f"{vl.url}/tokenize", json={"model": "tiny-vl", "messages": messages(case)}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == case["input_ids"]


def test_each_image_is_encoded_once(vclient, vl):
    def encoded() -> float:
        text = httpx.get(f"{vl.url}/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith("rserve:images_encoded_total{"))
        return float(line.rsplit(" ", 1)[1])

    before = encoded()
    case = CASES["two_images"]
    # a salt of its own: images whose tokens the prefix cache holds are not encoded again
    kw = dict(model="tiny-vl", messages=messages(case), max_tokens=2, extra_body={"cache_salt": "enc"})
    vclient.chat.completions.create(**kw)
    assert encoded() == before + 2
    vclient.chat.completions.create(**kw)
    assert encoded() == before + 2


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (a decompression bomb's signature)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path.startswith("/slow"):
            time.sleep(3)
        body = (VISION / "rgb_50x70.png").read_bytes()
        if self.path.startswith("/huge"):
            # past the 20 MiB an image may take
            body += bytes(21 << 20)
        if self.path.startswith("/missing"):
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def image_host():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_http_urls_are_fetched(vclient, image_host):
    case = CASES["one_image"]
    r = vclient.chat.completions.create(
        model="tiny-vl",
        messages=messages(case, [f"{image_host}/ok.png"]),
        max_tokens=len(case["tokens"]),
        temperature=0,
        logprobs=True,
        extra_body=EXTRA,
    )
    assert token_ids(r.choices[0].logprobs) == case["tokens"]


def bad(vclient, urls: list[str]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(
            model="tiny-vl", messages=messages(CASES["one_image"], urls), max_tokens=2
        )
    body = e.value.body
    assert isinstance(body, dict) and body.get("type") == "BadRequestError", body
    return e.value


def test_bad_images_are_400s_and_the_server_keeps_serving(vclient, vl, image_host):
    not_image = "data:image/png;base64," + base64.b64encode(b"hello, not an image").decode()
    bomb = "data:image/png;base64," + base64.b64encode(png_header_only(20000, 20000)).decode()
    cases = {
        "invalid base64": ["data:image/png;base64,@@@@"],
        "not an image": [not_image],
        "decompression bomb": [bomb],
        "too many images": [data_uri("rgb_50x70")] * 3,
        "timeout": [f"{image_host}/slow.png"],
        "too large": [f"{image_host}/huge.png"],
        "http error": [f"{image_host}/missing.png"],
        "file outside the allowed path": ["file:///etc/hostname"],
        "unsupported scheme": ["ftp://example.com/a.png"],
    }
    for what, urls in cases.items():
        e = bad(vclient, urls)
        assert e.status_code == 400, what
    assert "more than the limit" in bad(vclient, [bomb]).message
    assert "At most 2 image" in bad(vclient, cases["too many images"]).message
    assert "larger than the limit" in bad(vclient, cases["too large"]).message
    # still serving
    assert httpx.get(f"{vl.url}/health", timeout=10).status_code == 200
    test_greedy_tokens_and_usage_match_transformers(vclient, "one_image")


def test_an_image_for_a_text_model_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=messages(CASES["one_image"]), max_tokens=2
        )
    assert "image" in e.value.message


def test_text_only_chat_on_a_vision_model(vclient):
    case = CASES["text_only"]
    r = vclient.chat.completions.create(
        model="tiny-vl",
        messages=[{"role": "user", "content": case["text"]}],
        max_tokens=len(case["tokens"]),
        temperature=0,
        logprobs=True,
        extra_body=EXTRA,
    )
    assert token_ids(r.choices[0].logprobs) == case["tokens"]


def _bench_serve(vl, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(binary_path()), "bench", "serve", "--base-url", f"{vl.url}/v1", "--model", "tiny-vl", "--json", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_bench_serve_sends_random_images(vl):
    """`rserve bench serve --dataset-name random-mm` (vLLM's dataset): chat requests of random
    images and words; the prompt tokens are the server's count, image tokens included."""
    mm = ["--dataset-name", "random-mm", "--num-prompts", "3", "--max-concurrency", "2",
          "--random-input-len", "6", "--random-output-len", "4",
          "--random-mm-base-items-per-request", "2", "--random-mm-bucket-config", "{(56, 56, 1): 1.0}"]
    r = _bench_serve(vl, *mm)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["successful"], rep["failed"], rep["dataset"]) == (3, 0, "random-mm")
    # two 56x56 images are 2 x 4 merged tokens, beside the words and the chat template
    assert rep["prompt_tokens_mean"] > 6 + 8
    assert rep["output_throughput"] > 0
    # the same length as token ids, the text-only load the image one is compared with
    n = round(rep["prompt_tokens_mean"])
    r = _bench_serve(vl, "--num-prompts", "2", "--random-input-len", str(n), "--random-output-len", "4")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["successful"], rep["prompt_tokens_mean"]) == (2, n)
    bad = _bench_serve(vl, *mm[:-1], "{(56, 56, 8): 1.0}")
    assert bad.returncode != 0 and "only images" in bad.stderr


LLAVA_GOLDEN = json.loads((REPO_ROOT / "tests" / "fixtures" / "goldens" / "llava.json").read_text())


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> RserveProcess:
    srv = RserveProcess(
        "llava",
        [str(binary_path())],
        REPO_ROOT / "tests" / "fixtures" / "models" / "llava",
        tmp_path_factory.mktemp("rserve-llava"),
        served_model_name="tiny-llava",
        max_model_len=256,
    )
    yield from running(srv)


def test_llava_through_the_openai_client(llava):
    client = OpenAI(base_url=f"{llava.url}/v1", api_key="none", max_retries=0, timeout=60)
    case = {c["name"]: c for c in LLAVA_GOLDEN["cases"]}["wide_image"]
    kw = dict(model="tiny-llava", messages=messages(case), max_tokens=len(case["tokens"]), temperature=0)
    r = client.chat.completions.create(**kw, logprobs=True, extra_body=EXTRA)
    assert token_ids(r.choices[0].logprobs) == case["tokens"]
    assert r.usage.prompt_tokens == len(case["input_ids"])
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)
    assert text == r.choices[0].message.content
