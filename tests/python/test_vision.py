"""Images in the offline API (tiny Qwen2.5-VL fixture, goldens from transformers):
`llm.generate({"prompt": ..., "multi_modal_data": {"image": ...}})` with encoded bytes or PIL
images and `llm.chat` with `image_url` parts give transformers' greedy tokens, alone and batched
with text prompts, in `generate`, `stream` and `astream`; bad images are ValueErrors."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import pytest

from rserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "tests" / "fixtures" / "models"
VL = MODELS_DIR / "qwen2_5_vl"
QWEN2 = REPO / "tests" / "fixtures" / "models" / "qwen2"
VISION = REPO / "tests" / "fixtures" / "vision"
CASES = {c["name"]: c for c in json.loads((REPO / "tests/fixtures/goldens/qwen2_5_vl.json").read_text())["cases"]}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def image(name: str) -> bytes:
    return (VISION / f"{name}.png").read_bytes()


def prompt(case: dict) -> dict:
    return {"prompt": case["rendered"], "multi_modal_data": {"image": [image(n) for n in case["images"]]}}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(VL), max_model_len=512)
    yield engine
    engine.shutdown()


def test_generate_with_images_matches_transformers(llm: LLM) -> None:
    names = ["one_image", "two_images", "text_only", "palette_image"]
    outs = llm.generate([prompt(CASES[n]) for n in names], greedy(8))
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == CASES[name]["tokens"], name
        assert out.prompt_token_ids == CASES[name]["input_ids"], name


def test_a_single_image_needs_no_list_and_pil_images_work(llm: LLM) -> None:
    case = CASES["one_image"]
    one = {"prompt": case["rendered"], "multi_modal_data": {"image": image("rgb_50x70")}}
    assert llm.generate(one, greedy(8))[0].outputs[0].token_ids == case["tokens"]
    pil = pytest.importorskip("PIL.Image")
    with pil.open(VISION / "rgb_50x70.png") as img:
        one = {"prompt": case["rendered"], "multi_modal_data": {"image": img.convert("RGB")}}
        assert llm.generate(one, greedy(8))[0].outputs[0].token_ids == case["tokens"]


def test_chat_with_image_url_parts(llm: LLM) -> None:
    case = CASES["two_images"]
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image(n)).decode()}}
        for n in case["images"]
    ]
    msgs = [{"role": "user", "content": [*parts, {"type": "text", "text": case["text"]}]}]
    out = llm.chat(msgs, greedy(8))[0]
    assert out.outputs[0].token_ids == case["tokens"]
    assert out.prompt_token_ids == case["input_ids"]


def test_stream_and_astream_take_images(llm: LLM) -> None:
    case = CASES["wide_image"]
    last = list(llm.stream(prompt(case), greedy(8)))[-1]
    assert last.outputs[0].token_ids == case["tokens"]

    async def run():
        return await llm.agenerate(prompt(case), greedy(8))

    assert asyncio.run(run()).outputs[0].token_ids == case["tokens"]


def test_bad_images_are_value_errors(llm: LLM) -> None:
    case = CASES["one_image"]
    with pytest.raises(ValueError, match="invalid image"):
        llm.generate({"prompt": case["rendered"], "multi_modal_data": {"image": b"not an image"}}, greedy(2))
    with pytest.raises(ValueError, match="placeholders"):
        llm.generate({"prompt": case["rendered"], "multi_modal_data": {"image": [image("rgb_50x70")] * 2}}, greedy(2))
    with pytest.raises(TypeError, match="PIL.Image or encoded bytes"):
        llm.generate({"prompt": case["rendered"], "multi_modal_data": {"image": 3}}, greedy(2))
    with pytest.raises(ValueError, match="only `image`"):
        llm.generate({"prompt": case["rendered"], "multi_modal_data": {"video": []}}, greedy(2))
    # still serving
    assert llm.generate(prompt(case), greedy(8))[0].outputs[0].token_ids == case["tokens"]


def test_media_settings_limit_images_and_where_they_come_from() -> None:
    case = CASES["two_images"]
    engine = LLM(str(VL), max_model_len=512, limit_mm_per_prompt={"image": 1, "video": 0},
                 allowed_local_media_path=str(VISION), allowed_media_domains=["images.example.com"])
    try:
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            engine.generate(prompt(case), greedy(2))
        one = CASES["one_image"]
        # file:// under the allowed directory
        parts = [{"type": "image_url", "image_url": {"url": f"file://{VISION / (one['images'][0] + '.png')}"}},
                 {"type": "text", "text": one["text"]}]
        out = engine.chat([{"role": "user", "content": parts}], greedy(8))[0]
        assert out.outputs[0].token_ids == one["tokens"]
        outside = [{"type": "image_url", "image_url": {"url": f"file://{REPO / 'README.md'}"}}]
        with pytest.raises(ValueError, match="allowed-local-media-path"):
            engine.chat([{"role": "user", "content": outside}], greedy(2))
        elsewhere = [{"type": "image_url", "image_url": {"url": "https://evil.example.org/a.png"}}]
        with pytest.raises(ValueError, match="allowed-media-domains"):
            engine.chat([{"role": "user", "content": elsewhere}], greedy(2))
        # the engine's HTTP routes (what the Ray deployment serves) keep the same settings
        app = engine._engine.http_app("vl")
        for content in (elsewhere, outside):
            body = json.dumps({"model": "vl", "max_tokens": 2,
                               "messages": [{"role": "user", "content": content}]}).encode()
            res = app.start("POST", "/v1/chat/completions", [("content-type", "application/json")], body)
            head = res.head(30.0)
            assert head is not None and head[0] == 400, head
            chunks = []
            while True:
                try:
                    chunk = res.next_chunk(30.0)
                except StopIteration:
                    break
                assert chunk is not None, "the body did not come"
                chunks.append(chunk)
            err = json.loads(b"".join(chunks))
            assert "allowed" in err["error"]["message"], err
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(VL), max_model_len=512, limit_mm_per_prompt={"video": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(VL), max_model_len=512, limit_mm_per_prompt={"image": 1, "video": "x"})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(VL), max_model_len=512, limit_mm_per_prompt={"image": -1})


def test_a_text_model_refuses_images() -> None:
    engine = LLM(str(QWEN2), max_model_len=128)
    try:
        with pytest.raises(ValueError, match="does not take images"):
            engine.generate({"prompt": "hi", "multi_modal_data": {"image": image("rgb_50x70")}}, greedy(2))
        buf = io.BytesIO(image("rgb_50x70"))
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(ValueError, match="image"):
            engine.chat(msgs, greedy(2))
    finally:
        engine.shutdown()


def test_llava_generate_and_chat_match_transformers() -> None:
    cases = {c["name"]: c for c in json.loads((REPO / "tests/fixtures/goldens/llava.json").read_text())["cases"]}
    engine = LLM(str(MODELS_DIR / "llava"), max_model_len=256)
    try:
        names = ["one_image", "two_images", "text_only"]
        outs = engine.generate([prompt(cases[n]) for n in names], greedy(8))
        assert [o.outputs[0].token_ids for o in outs] == [cases[n]["tokens"] for n in names]
        case = cases["wide_image"]
        url = "data:image/png;base64," + base64.b64encode(image("rgb_160x120")).decode()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": case["text"]}]}]
        out = engine.chat(msgs, greedy(8))[0]
        assert out.outputs[0].token_ids == case["tokens"]
        assert out.prompt_token_ids == case["input_ids"]
    finally:
        engine.shutdown()
