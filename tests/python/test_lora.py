"""`LLM(..., enable_lora=True)` with `lora_request=LoRARequest(name, int_id, path)` (vLLM's
offline API): the adapter loads the first time a request names it, its greedy tokens are peft's
(tests/fixtures/goldens/lora-qwen2-r8-all.json) in `generate`, `stream` and `astream`, one
request for all prompts or one per prompt mixed with base prompts; bad adapters and misuse are
ValueErrors naming the adapter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rserve import LLM, LoRARequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
QWEN2 = REPO / "tests" / "fixtures" / "models" / "qwen2"
ADAPTER = REPO / "adapters" / "fixtures" / "qwen2-r8-all"
GOLDENS = REPO / "tests" / "fixtures" / "goldens"


def cases(name: str) -> list[dict]:
    return json.loads((GOLDENS / f"{name}.json").read_text())["cases"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(QWEN2), max_model_len=128, enable_lora=True, max_loras=2)
    yield engine
    engine.shutdown()


def test_lora_requests_decode_as_peft_mixed_with_base_prompts(llm: LLM) -> None:
    lora = LoRARequest("r8", 1, str(ADAPTER))
    want = cases("lora-qwen2-r8-all")
    outs = llm.generate([c["prompt"] for c in want], greedy(16), lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == [c["tokens"] for c in want]
    base = cases("qwen2")
    mixed = want[:2] + base[:2]
    outs = llm.generate(
        [c["prompt"] for c in mixed], greedy(16), lora_request=[lora, lora, None, None]
    )
    assert [o.outputs[0].token_ids for o in outs] == [c["tokens"] for c in mixed]


def test_stream_and_astream_take_the_adapter(llm: LLM) -> None:
    lora = LoRARequest("r8", 1, str(ADAPTER))
    case = cases("lora-qwen2-r8-all")[2]
    last = list(llm.stream(case["prompt"], greedy(16), lora_request=lora))[-1]
    assert last.outputs[0].token_ids == case["tokens"]
    out = asyncio.run(llm.agenerate(case["prompt"], greedy(16), lora_request=lora))
    assert out.outputs[0].token_ids == case["tokens"]


def test_chat_takes_the_adapter_for_all_or_per_conversation(llm: LLM) -> None:
    lora = LoRARequest("r8", 1, str(ADAPTER))
    conv = [{"role": "user", "content": "Say something."}]
    greedy8 = greedy(8)
    adapted = llm.chat(conv, greedy8, lora_request=lora)[0]
    base = llm.chat(conv, greedy8)[0]
    # the same prompt as a token-id prompt through generate, with and without the adapter
    ids = adapted.prompt_token_ids
    assert adapted.outputs[0].token_ids == llm.generate(ids, greedy8, lora_request=lora)[0].outputs[0].token_ids
    assert base.outputs[0].token_ids == llm.generate(ids, greedy8)[0].outputs[0].token_ids
    both = llm.chat([conv, conv], greedy8, lora_request=[lora, None])
    assert [o.outputs[0].token_ids for o in both] == [adapted.outputs[0].token_ids, base.outputs[0].token_ids]


def test_lora_misuse_is_a_value_error(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate("hi", greedy(2), lora_request=LoRARequest("fresh", 5))
    llm.generate("hi", greedy(2), lora_request=LoRARequest("r8", 1, str(ADAPTER)))
    with pytest.raises(ValueError, match="already loaded"):
        llm.generate("hi", greedy(2), lora_request=LoRARequest("r8", 2, str(ADAPTER)))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_dora": true}')
    with pytest.raises(ValueError, match="broken.*DoRA"):
        llm.generate("hi", greedy(2), lora_request=LoRARequest("broken", 3, str(broken)))
    with pytest.raises(ValueError, match="2 given for 1"):
        llm.generate(["hi"], greedy(2), lora_request=[None, None])
    with pytest.raises(ValueError):
        LoRARequest("", 1, "x")
    llm.unload_lora("r8")
    with pytest.raises(ValueError):
        llm.unload_lora("r8")


def test_adapters_need_enable_lora() -> None:
    plain = LLM(str(QWEN2), max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable-lora"):
            plain.generate("hi", greedy(2), lora_request=LoRARequest("r8", 1, str(ADAPTER)))
    finally:
        plain.shutdown()
