"""LoRA adapters over HTTP (`--enable-lora`, vLLM's surface) through the official `openai`
client: an adapter is a model in /v1/models whose parent is the base; `model` = the adapter's
name selects it in completions and chat, streamed or not, and its greedy tokens are peft's
(tests/fixtures/goldens/lora-qwen2-r8-all.json) while base requests beside them stay the base's;
unknown names are 404s; adapters load and unload at runtime when
RSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 (else the routes are 404), with clear errors for a taken
name, an unknown one and adapters that do not fit, and the server keeps serving;
vllm:lora_requests_info reports the adapters in use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from support.rserve_process import RserveProcess, binary_path, running

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "tests" / "fixtures" / "models" / "qwen2"
ADAPTERS = REPO / "adapters" / "fixtures"
GOLDENS = REPO / "tests" / "fixtures" / "goldens"
BASE = "tiny-qwen"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    srv = RserveProcess(
        "lora",
        [str(binary_path())],
        MODEL,
        tmp_path_factory.mktemp("rserve-lora"),
        served_model_name=BASE,
        max_model_len=256,
        extra_args=[
            "--dtype",
            "float32",
            "--enable-lora",
            "--lora-modules",
            f"qwen-r8={ADAPTERS / 'qwen2-r8-all'}",
            json.dumps({"name": "qwen-json", "path": str(ADAPTERS / "qwen2-r8-all"), "base_model_name": "org/base"}),
            "--max-loras",
            "2",
        ],
        env={**os.environ, "RSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield from running(srv)


@pytest.fixture(scope="module")
def lclient(lora_server) -> OpenAI:
    c = OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=120.0)
    yield c
    c.close()


def golden(name: str) -> list[dict]:
    return json.loads((GOLDENS / f"{name}.json").read_text())["cases"]


def greedy_ids(client: OpenAI, model: str, prompt: list[int], n: int) -> list[int]:
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert r.model == model
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def test_adapters_are_models_whose_parent_is_the_base(lclient: OpenAI) -> None:
    models = {m.id: m for m in lclient.models.list().data}
    assert set(models) >= {BASE, "qwen-r8"}
    assert models["qwen-r8"].model_extra["parent"] == BASE
    assert models[BASE].model_extra["parent"] is None
    # vLLM's JSON form names the parent with base_model_name
    assert models["qwen-json"].model_extra["parent"] == "org/base"
    assert lclient.models.retrieve("qwen-r8").id == "qwen-r8"
    with pytest.raises(openai.NotFoundError):
        lclient.models.retrieve("nope")


def test_an_adapter_named_as_the_served_model_is_refused_at_start(tmp_path) -> None:
    args = [str(binary_path()), "serve", str(MODEL), "--served-model-name", BASE, "--port", "0",
            "--enable-lora", "--lora-modules", f"{BASE}={ADAPTERS / 'qwen2-r8-all'}"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    assert "served model's name" in r.stderr, r.stderr[-2000:]


def test_adapter_and_base_requests_together_decode_as_peft_and_the_base(lclient: OpenAI) -> None:
    jobs = [("qwen-r8", c) for c in golden("lora-qwen2-r8-all")]
    jobs += [(BASE, c) for c in golden("qwen2")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(
            pool.map(lambda j: greedy_ids(lclient, j[0], j[1]["prompt"], len(j[1]["tokens"])), jobs)
        )
    for (model, case), ids in zip(jobs, got):
        assert ids == case["tokens"], (model, len(case["prompt"]))


def test_chat_and_streams_select_the_adapter(lclient: OpenAI) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    kw = {"messages": msgs, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    lora = lclient.chat.completions.create(model="qwen-r8", **kw)
    base = lclient.chat.completions.create(model=BASE, **kw)
    assert lora.model == "qwen-r8"
    assert lora.choices[0].message.content != base.choices[0].message.content
    chunks = lclient.chat.completions.create(model="qwen-r8", stream=True, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == lora.choices[0].message.content
    plain = lclient.completions.create(model="qwen-r8", prompt="hi", max_tokens=6, temperature=0)
    streamed = lclient.completions.create(
        model="qwen-r8", prompt="hi", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    with pytest.raises(openai.NotFoundError):
        lclient.chat.completions.create(model="qwen-r9", **kw)


def test_adapters_load_and_unload_at_runtime(lora_server, lclient: OpenAI, tmp_path: Path) -> None:
    url = lora_server.url
    post = lambda path, body: httpx.post(f"{url}/v1/{path}", json=body, timeout=60)  # noqa: E731
    r = post("load_lora_adapter", {"lora_name": "second", "lora_path": str(ADAPTERS / "qwen2-r8-all")})
    assert r.status_code == 200, r.text
    assert "second" in {m.id for m in lclient.models.list().data}
    case = golden("lora-qwen2-r8-all")[1]
    assert greedy_ids(lclient, "second", case["prompt"], len(case["tokens"])) == case["tokens"]
    # a taken name, an adapter of another base, a missing directory, a bad body: 400s
    r = post("load_lora_adapter", {"lora_name": "second", "lora_path": str(ADAPTERS / "qwen2-r8-all")})
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((ADAPTERS / "qwen2-r8-all" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    shutil.copy(ADAPTERS / "qwen2-r8-all" / "adapter_model.safetensors", dora)
    r = post("load_lora_adapter", {"lora_name": "dora", "lora_path": str(dora)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"], r.text
    (dora / "adapter_config.json").write_text(json.dumps(config))
    (dora / "adapter_model.safetensors").write_bytes(b"truncated")
    r = post("load_lora_adapter", {"lora_name": "dora", "lora_path": str(dora)})
    assert r.status_code == 400 and "dora" in r.json()["error"]["message"], r.text
    r = post("load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
    assert r.status_code == 400, r.text
    assert post("load_lora_adapter", {"lora_name": "x"}).status_code == 400
    # unload: the name is gone for new requests; an unknown name is a 404
    r = post("unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        lclient.completions.create(model="second", prompt="hi", max_tokens=2)
    assert post("unload_lora_adapter", {"lora_name": "second"}).status_code == 404
    # still serving the rest
    assert greedy_ids(lclient, "qwen-r8", case["prompt"], len(case["tokens"])) == case["tokens"]


def write_adapter(path: Path, a_width: int) -> None:
    """A rank-4 PEFT adapter on q_proj of layer 0 whose lora_A rows are `a_width` wide (the base's
    are 64), written as safetensors by hand."""
    import struct

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    shapes = {f"{prefix}.lora_A.weight": [4, a_width], f"{prefix}.lora_B.weight": [64, 4]}
    header, at = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + size]}
        at += size
    head = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(at))


def test_an_adapter_of_another_shape_is_a_400_naming_it(lora_server, tmp_path: Path) -> None:
    write_adapter(tmp_path / "narrow", 48)
    r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter",
                   json={"lora_name": "narrow", "lora_path": str(tmp_path / "narrow")}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "narrow" in message and "q_proj" in message, message
    assert httpx.get(f"{lora_server.url}/health", timeout=10).status_code == 200


def test_unloading_while_requests_stream_lets_them_finish(lora_server, lclient: OpenAI) -> None:
    url = lora_server.url
    post = lambda path, body: httpx.post(f"{url}/v1/{path}", json=body, timeout=60)  # noqa: E731
    assert post("load_lora_adapter", {"lora_name": "busy", "lora_path": str(ADAPTERS / "qwen2-r8-all")}).status_code == 200
    cases = golden("lora-qwen2-r8-all")
    # every stream has its first chunk (the server took it with the adapter) before the unload
    started = threading.Barrier(len(cases) + 1, timeout=60)

    def streamed(case: dict) -> list[int]:
        stream = lclient.completions.create(
            model="busy", prompt=case["prompt"], max_tokens=len(case["tokens"]), temperature=0, stream=True,
            logprobs=1, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        ids = []
        for i, chunk in enumerate(stream):
            if i == 0:
                started.wait()
            for tok in chunk.choices[0].logprobs.tokens if chunk.choices and chunk.choices[0].logprobs else []:
                ids.append(int(tok.split(":")[1]))
        return ids

    with ThreadPoolExecutor(len(cases) + 1) as pool:
        running = [pool.submit(streamed, c) for c in cases]
        started.wait()
        # unload (and load another name) while they run: they keep the adapter they started with
        assert post("unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
        assert post("load_lora_adapter", {"lora_name": "after", "lora_path": str(ADAPTERS / "qwen2-r8-all")}).status_code == 200
        got = [f.result(timeout=120) for f in running]
    assert got == [c["tokens"] for c in cases]
    with pytest.raises(openai.NotFoundError):
        lclient.completions.create(model="busy", prompt="hi", max_tokens=2)
    assert post("unload_lora_adapter", {"lora_name": "after"}).status_code == 200


def test_a_reloaded_name_is_the_served_models_child(lora_server, lclient: OpenAI) -> None:
    """`base_model_name` belongs to the adapter loaded at start: unloaded and loaded again at
    runtime, the name's parent is the served model."""
    url = lora_server.url
    post = lambda path, body: httpx.post(f"{url}/v1/{path}", json=body, timeout=60)  # noqa: E731
    assert post("unload_lora_adapter", {"lora_name": "qwen-json"}).status_code == 200
    assert post("load_lora_adapter", {"lora_name": "qwen-json", "lora_path": str(ADAPTERS / "qwen2-r8-all")}).status_code == 200
    models = {m.id: m for m in lclient.models.list().data}
    assert models["qwen-json"].model_extra["parent"] == BASE


def test_lora_requests_info_is_exported(lora_server, lclient: OpenAI) -> None:
    lclient.completions.create(model="qwen-r8", prompt="hi", max_tokens=2)
    text = httpx.get(f"{lora_server.url}/metrics", timeout=30).text
    assert "# TYPE vllm:lora_requests_info gauge" in text
    assert 'vllm:lora_requests_info{max_lora="2",' in text


def test_runtime_updates_are_off_without_the_variable(http: httpx.Client) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404
    assert "RSERVE_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]


def test_runtime_updates_take_vllms_variable_and_the_api_key(tmp_path_factory) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RSERVE_ALLOW_RUNTIME_LORA_UPDATING"}
    srv = RserveProcess(
        "lora-key",
        [str(binary_path())],
        MODEL,
        tmp_path_factory.mktemp("rserve-lora-key"),
        served_model_name=BASE,
        max_model_len=256,
        extra_args=["--dtype", "float32", "--enable-lora", "--api-key", "sekrit"],
        env={**env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    servers = running(srv)
    s = next(servers)
    try:
        body = {"lora_name": "k", "lora_path": str(ADAPTERS / "qwen2-r8-all")}
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 401, r.text
        r = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "k"}, timeout=60)
        assert r.status_code == 401, r.text
        auth = {"Authorization": "Bearer sekrit"}
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "k"}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        servers.close()
