"""Tests of the in-process Python API (`rserve.LLM`, `rserve.SamplingParams`) and the `rserve`
console script.

The model is the tiny random-weight qwen2 fixture (vocabulary of 1000 tokens, EOS id 3, ChatML
template) with a 256-token context: its text is nonsense, but greedy decoding is deterministic,
which is what most assertions rely on.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

try:
    import rserve._core as _core
except ImportError as e:
    pytest.skip(
        f"rserve._core (the native module) cannot be imported ({type(e).__name__}: {e}); "
        "build it with `maturin develop --release` or `pip install .`",
        allow_module_level=True,
    )

import rserve
from rserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from rserve.cli import prepare_argv

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN2 = REPO_ROOT / "tests" / "fixtures" / "models" / "qwen2"
MAX_MODEL_LEN = 256
CONTEXT_ERROR = "maximum context length is 256 tokens"
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]
TIMEOUT_S = 120


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids_of(out: RequestOutput, i: int = 0) -> list[int]:
    return out.outputs[i].token_ids


def run_async(coro: Any) -> Any:
    """Runs a coroutine with an overall deadline (no pytest-asyncio needed)."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, TIMEOUT_S)

    return asyncio.run(bounded())


# ------------------------------------------------------------------------------------------------
# spies: see what LLM does with the native engine
# ------------------------------------------------------------------------------------------------


class SpyStream:
    """Wraps a native RequestStream, recording aborts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.aborted = threading.Event()

    @property
    def request_id(self) -> int:
        return self.inner.request_id

    def __iter__(self) -> SpyStream:
        return self

    def __next__(self) -> str:
        return next(self.inner)

    def next_timeout(self, timeout_s: float) -> str | None:
        return self.inner.next_timeout(timeout_s)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.inner.prompt_token_ids

    def result(self) -> str:
        return self.inner.result()

    def abort(self) -> None:
        self.aborted.set()
        self.inner.abort()

    def drain(self) -> list[dict[str, Any]]:
        """The deltas left in the native stream, up to its end."""
        return [json.loads(raw) for raw in self.inner]


class SpyEngine:
    """Wraps the native Engine, keeping the streams it hands out."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.streams: list[SpyStream] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(
        self,
        prompt: Any,
        params_json: str,
        lora: str | None = None,
        images: list[bytes] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> SpyStream:
        s = SpyStream(self.inner.submit(prompt, params_json, lora, images, cache_salt=cache_salt))
        self.streams.append(s)
        return s


@pytest.fixture
def spy(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> SpyEngine:
    engine = SpyEngine(llm._engine)
    monkeypatch.setattr(llm, "_engine", engine)
    return engine


def assert_aborted(stream: SpyStream, max_tokens: int) -> None:
    """The request was aborted: abort() was called and the stream ends (with finish reason
    `abort`, unless it had already produced every token: `length`)."""
    assert stream.aborted.wait(10), "abort() was not called"
    rest = stream.drain()
    if rest:
        final = rest[-1]
        assert final["finished"]
        out = final["outputs"][0]
        assert out["finish_reason"] in ("abort", "length"), out


# ------------------------------------------------------------------------------------------------
# package basics
# ------------------------------------------------------------------------------------------------


def test_import_is_cheap(subprocess_env: dict[str, str]) -> None:
    code = "import sys, rserve; print(sorted(m for m in ('rserve._core', 'pydantic', 'huggingface_hub') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", "import rserve loaded heavy modules: " + r.stdout


def test_version() -> None:
    assert isinstance(rserve.__version__, str) and rserve.__version__
    assert _core.version()


def test_sampling_params_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.stop, p.stop_token_ids, p.logit_bias) == (16, 0, None, None, None, None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"temperature": float("nan")}, "temperature"),
        # decided by the native parser (the server's), not by pydantic's field constraints
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"logit_bias": {5: 500.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value), str(err.value)


def test_sampling_params_assignment_is_validated() -> None:
    p = SamplingParams()
    with pytest.raises(ValueError, match="temperature"):
        p.temperature = -1


def test_sampling_params_accepts_vllm_spellings() -> None:
    p = SamplingParams(top_k=-1, stop="END", logit_bias={7: -100.0}, seed=3, stop_token_ids=[3])
    engine_json = json.loads(p.to_engine_json())
    assert engine_json["stop"] == "END" and engine_json["logit_bias"] == {"7": -100.0}
    assert _core.check_params(p.to_engine_json()) == p.to_engine_json()


def test_unknown_llm_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="pipeline_parallel_size"):
        LLM(str(QWEN2), pipeline_parallel_size=2)


def test_engine_options_pass_through(llm: LLM) -> None:
    # vLLM's engine keywords reach the engine: eager mode gives the default engine's greedy tokens
    eager = LLM(
        str(QWEN2),
        max_model_len=llm.max_model_len,
        enforce_eager=True,
        async_scheduling=False,
        block_size=32,
    )
    try:
        want = llm.generate("Hello there", greedy())[0]
        got = eager.generate("Hello there", greedy())[0]
        assert ids_of(got) == ids_of(want)
    finally:
        eager.shutdown()
    with pytest.raises(TypeError):
        LLM(str(QWEN2), enforce_eager="yes")


def test_prefix_caching_reports_cached_tokens_and_resets(llm: LLM) -> None:
    # on by default: the second run of a long prompt starts from its cached full blocks
    prompt = " ".join(f"token{i}" for i in range(40))
    first = llm.generate(prompt, greedy())[0]
    second = llm.generate(prompt, greedy())[0]
    assert second.num_cached_tokens is not None and second.num_cached_tokens >= 16
    assert second.num_cached_tokens > (first.num_cached_tokens or 0)
    assert ids_of(second) == ids_of(first)
    assert llm.reset_prefix_cache() > 0
    assert llm.generate(prompt, greedy())[0].num_cached_tokens == 0
    off = LLM(str(QWEN2), max_model_len=llm.max_model_len, enable_prefix_caching=False)
    try:
        again = [off.generate(prompt, greedy())[0] for _ in range(2)]
        assert [o.num_cached_tokens for o in again] == [0, 0]
        assert ids_of(again[1]) == ids_of(first)
    finally:
        off.shutdown()


def test_cache_salts_keep_prompts_apart(llm: LLM) -> None:
    # vLLM's prompt-dict field: only prompts of the same salt share cached blocks
    prompt = " ".join(f"salted{i}" for i in range(40))
    first = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, greedy())[0]
    other = llm.generate({"prompt": prompt, "cache_salt": "tenant-b"}, greedy())[0]
    same = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, greedy())[0]
    unsalted = llm.generate(prompt, greedy())[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert same.num_cached_tokens is not None and same.num_cached_tokens >= 16
    assert ids_of(same) == ids_of(first) == ids_of(other)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, greedy())
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": 3}, greedy())


def test_isq_quantizes_while_loading() -> None:
    q = LLM(str(QWEN2), max_model_len=128, isq="q8_0")
    try:
        out = q.generate("Hello there", greedy())[0]
        assert len(ids_of(out)) > 0
    finally:
        q.shutdown()
    with pytest.raises(ValueError, match="q4k"):
        LLM(str(QWEN2), isq="int3")


def test_quantization_fp8_is_isq_fp8() -> None:
    q = LLM(str(QWEN2), max_model_len=128, quantization="fp8")
    try:
        assert len(ids_of(q.generate("Hello there", greedy())[0])) > 0
    finally:
        q.shutdown()
    with pytest.raises(ValueError, match="fp8"):
        LLM(str(QWEN2), quantization="awq")
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(QWEN2), quantization="fp8", isq="q8_0")


def test_tensor_parallel_refusals_are_value_errors() -> None:
    # the CPU build runs on one device; a GPU build on the CPU says so too
    with pytest.raises(ValueError, match="CUDA"):
        LLM(str(QWEN2), device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        LLM(str(QWEN2), tensor_parallel_size=0)
    # the fixture's 4 heads do not split over 8 GPUs, whatever the machine has
    with pytest.raises(ValueError, match="4 attention heads"):
        LLM(str(QWEN2), tensor_parallel_size=8)
    with pytest.raises(ValueError, match="LoRA"):
        LLM(str(QWEN2), tensor_parallel_size=2, enable_lora=True)


def test_isq_lm_head_needs_isq_and_quantizes_the_head() -> None:
    with pytest.raises(ValueError, match="isq"):
        LLM(str(QWEN2), isq_lm_head=True)
    q = LLM(str(QWEN2), max_model_len=128, isq="q8_0", isq_lm_head=True)
    try:
        assert len(ids_of(q.generate("Hello there", greedy())[0])) > 0
    finally:
        q.shutdown()


def test_a_gguf_file_loads_with_its_own_tokenizer_and_template(llm: LLM) -> None:
    gguf = REPO_ROOT / "tests" / "fixtures" / "gguf" / "qwen2-q8_0.gguf"
    q = LLM(str(gguf), max_model_len=128)
    try:
        assert q.vocab_size == 1000
        # the same tokenizer as the directory fixtures', rebuilt from the GGUF metadata
        assert q.encode("Hello there, 12345!") == llm.encode("Hello there, 12345!")
        out = q.chat([{"role": "user", "content": "hi"}], greedy())[0]
        assert len(ids_of(out)) > 0
    finally:
        q.shutdown()


def test_missing_model_dir_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        LLM(str(tmp_path / "no" / "such" / "model"))


def test_broken_model_dir_is_a_runtime_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((QWEN2 / "config.json").read_bytes())
    with pytest.raises(RuntimeError) as err:
        LLM(str(tmp_path))
    assert str(err.value)


def test_engine_facts_and_tokenizer(llm: LLM) -> None:
    assert llm.max_model_len == MAX_MODEL_LEN
    assert llm.vocab_size == 1000
    assert Path(llm.model_dir).resolve() == QWEN2.resolve()
    ids = llm.encode(PROMPT)
    assert ids and all(0 <= t < 1000 for t in ids)
    assert llm.encode(PROMPT, add_special_tokens=False) == ids[1:]  # qwen2 fixture prepends BOS
    assert llm.decode(ids) == PROMPT


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


def test_generate_string_prompt(llm: LLM) -> None:
    outs = llm.generate(PROMPT, greedy(8))
    assert len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == PROMPT
    assert out.prompt_token_ids == llm.encode(PROMPT)
    assert len(out.outputs) == 1
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput)
    assert c.index == 0 and len(c.token_ids) == 8 and c.finish_reason == "length"
    assert all(0 <= t < 1000 for t in c.token_ids)
    assert c.text == llm.decode(c.token_ids)
    assert c.delta == c.text


def test_generate_token_ids_equal_text_prompt(llm: LLM) -> None:
    ids = llm.encode(PROMPT)
    by_text = llm.generate(PROMPT, greedy())[0]
    by_ids = llm.generate(ids, greedy())[0]
    assert by_ids.prompt is None
    assert by_ids.prompt_token_ids == ids
    assert ids_of(by_ids) == ids_of(by_text)
    as_dict = llm.generate({"prompt_token_ids": ids}, greedy())[0]
    assert ids_of(as_dict) == ids_of(by_text)


def test_generate_several_prompts_in_order_with_per_prompt_params(llm: LLM) -> None:
    prompts: list[str | list[int]] = ["Once upon a time", [5, 6, 7, 8], "Hello world"]
    params = [greedy(3), greedy(5), greedy(7)]
    outs = llm.generate(prompts, params)
    assert [len(ids_of(o)) for o in outs] == [3, 5, 7]
    assert [o.prompt for o in outs] == ["Once upon a time", None, "Hello world"]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    for p, sp, o in zip(prompts, params, outs):
        assert ids_of(llm.generate(p, sp)[0]) == ids_of(o)
    many = llm.generate([[9, 10], [11, 12, 13]], greedy(4))
    assert [o.prompt_token_ids for o in many] == [[9, 10], [11, 12, 13]]
    assert llm.generate([], greedy()) == []


def test_per_prompt_params_must_match_prompt_count(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(), greedy(), greedy()])


def test_default_params(llm: LLM) -> None:
    out = llm.generate(PROMPT)[0]
    assert 1 <= len(ids_of(out)) <= 16
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_greedy_is_deterministic(llm: LLM) -> None:
    first = llm.generate(PROMPT, greedy(16))[0]
    for _ in range(3):
        again = llm.generate(PROMPT, greedy(16))[0]
        assert again.outputs[0].text == first.outputs[0].text
        assert ids_of(again) == ids_of(first)


def test_n3_seeded_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    a = llm.generate(PROMPT, params)[0]
    b = llm.generate(PROMPT, params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1, "the 3 samples are identical"
    c = llm.generate(PROMPT, params.model_copy(update={"seed": 4321}))[0]
    assert [o.token_ids for o in c.outputs] != [o.token_ids for o in a.outputs]


def test_max_tokens_none_runs_to_the_end_of_the_context(llm: LLM) -> None:
    prompt = [300] * (MAX_MODEL_LEN - 6)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(ids_of(out)) == 6
    assert out.outputs[0].finish_reason == "length"


def test_stop_string(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(16))[0].outputs[0].text
    stop = next(
        (full[i : i + 3] for i in range(2, len(full) - 3) if full[i : i + 3].strip() and full.find(full[i : i + 3]) == i),
        None,
    )
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    out = llm.generate(PROMPT, greedy(16, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(4, logprobs=2, prompt_logprobs=1))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for lp, tok in zip(c.logprobs, c.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert 1 <= len(lp.top) <= 2 and all(isinstance(t, tuple) and len(t) == 2 for t in lp.top)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-3)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[-1] is not None
    assert llm.generate(PROMPT, greedy(4))[0].outputs[0].logprobs is None


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", [[]]], ids=["empty-text", "empty-ids"])
def test_empty_prompt_is_rejected(llm: LLM, prompt: Any) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, greedy())


@pytest.mark.parametrize(
    "prompt,max_tokens",
    [([300] * 300, 4), ([300] * 200, 100)],
    ids=["prompt-over-context", "prompt-plus-max-tokens-over-context"],
)
def test_prompt_over_context_is_rejected(llm: LLM, prompt: list[int], max_tokens: int) -> None:
    with pytest.raises(ValueError, match=CONTEXT_ERROR):
        llm.generate([prompt], greedy(max_tokens))
    with pytest.raises(ValueError, match=CONTEXT_ERROR):
        llm.stream(prompt, greedy(max_tokens))


def test_out_of_vocabulary_params_are_rejected_at_submit(llm: LLM) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, greedy(logit_bias={5000: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPT, greedy(stop_token_ids=[5000]))


def test_failed_batch_submission_aborts_the_submitted_requests(llm: LLM, spy: SpyEngine) -> None:
    with pytest.raises(ValueError, match=CONTEXT_ERROR):
        batch: list[str | list[int]] = [PROMPT, [300] * 300]
        llm.generate(batch, greedy(200))
    assert len(spy.streams) == 1
    assert_aborted(spy.streams[0], 200)


def test_bad_prompt_types(llm: LLM) -> None:
    with pytest.raises(TypeError):
        llm.generate(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        llm.generate([["a", "b"]])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# chat
# ------------------------------------------------------------------------------------------------


def test_chat_one_conversation(llm: LLM) -> None:
    out = llm.chat(MESSAGES, greedy(8))
    assert len(out) == 1
    r = out[0]
    ids = llm.apply_chat_template(MESSAGES)
    assert r.prompt_token_ids == ids
    assert r.prompt is not None and r.prompt.endswith("<|im_start|>assistant\n")
    assert "Tell me a story about a robot." in r.prompt
    assert ids_of(r) == ids_of(llm.generate([ids], greedy(8))[0])
    no_gen = llm.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ids[: len(no_gen)] == no_gen and len(no_gen) < len(ids)


def test_chat_several_conversations(llm: LLM) -> None:
    convs: list[list[dict[str, Any]]] = [
        MESSAGES,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    ]
    outs = llm.chat(convs, [greedy(3), greedy(5)])
    assert [len(ids_of(o)) for o in outs] == [3, 5]
    assert ids_of(outs[0]) == ids_of(llm.chat(MESSAGES, greedy(3))[0])
    assert "Be brief." in (outs[1].prompt or "")


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": [{"type": "image_url"}]}]],
    ids=["empty", "bad-role", "image-part"],
)
def test_chat_bad_messages(llm: LLM, messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError):
        llm.chat(messages, greedy())


# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------


def check_stream(outs: list[RequestOutput]) -> RequestOutput:
    """Snapshots grow, deltas add up to the text, only the last is finished; returns the last."""
    assert outs, "no outputs"
    previous = ""
    deltas = []
    for o in outs:
        text = o.outputs[0].text
        assert text.startswith(previous), (previous, text)
        assert text == previous + o.outputs[0].delta
        deltas.append(o.outputs[0].delta)
        previous = text
    assert all(not o.finished for o in outs[:-1])
    assert outs[-1].finished
    assert "".join(deltas) == outs[-1].outputs[0].text
    return outs[-1]


def test_stream(llm: LLM) -> None:
    outs = list(llm.stream(PROMPT, greedy(12)))
    assert len(outs) > 1
    last = check_stream(outs)
    expected = llm.generate(PROMPT, greedy(12))[0]
    assert ids_of(last) == ids_of(expected)
    assert last.outputs[0].text == expected.outputs[0].text
    assert len({o.request_id for o in outs}) == 1


def test_stream_with_n2(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    outs = list(llm.stream(PROMPT, params))
    assert all(len(o.outputs) == 2 for o in outs)
    final = llm.generate(PROMPT, params)[0]
    assert [o.token_ids for o in outs[-1].outputs] == [o.token_ids for o in final.outputs]
    for i in range(2):
        assert "".join(o.outputs[i].delta for o in outs) == outs[-1].outputs[i].text


def test_breaking_out_of_a_stream_aborts_the_request(llm: LLM, spy: SpyEngine) -> None:
    for _ in llm.stream(PROMPT, greedy(200)):
        break
    assert len(spy.streams) == 1
    assert_aborted(spy.streams[0], 200)


def test_native_stream_deltas_and_result(llm: LLM) -> None:
    stream = llm._engine.submit(PROMPT, greedy(8).to_engine_json())
    with pytest.raises(ValueError, match="nan"):
        stream.next_timeout(float("nan"))
    first = json.loads(next(stream))
    assert set(first) >= {"request_id", "outputs", "finished", "prompt_logprobs"}
    whole = json.loads(stream.result())
    assert whole["finished"]
    got = [t for o in first["outputs"] for t in o["token_ids"]]
    assert whole["outputs"][0]["token_ids"][: len(got)] == got
    assert len(whole["outputs"][0]["token_ids"]) == 8
    assert whole["prompt_token_ids"] == stream.prompt_token_ids == llm.encode(PROMPT)
    expected = llm.generate(PROMPT, greedy(8))[0]
    assert whole["outputs"][0]["text"] == expected.outputs[0].text


def test_stream_bad_input_raises_at_call(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.stream("", greedy())


def test_astream(llm: LLM) -> None:
    async def collect() -> list[RequestOutput]:
        return [o async for o in llm.astream(PROMPT, greedy(12))]

    outs = run_async(collect())
    last = check_stream(outs)
    assert ids_of(last) == ids_of(llm.generate(PROMPT, greedy(12))[0])


def test_agenerate(llm: LLM) -> None:
    out = run_async(llm.agenerate([5, 6, 7], greedy(9)))
    assert out.finished and ids_of(out) == ids_of(llm.generate([[5, 6, 7]], greedy(9))[0])
    assert out.outputs[0].delta == out.outputs[0].text


def test_16_concurrent_astreams_match_sequential_greedy(llm: LLM) -> None:
    prompts = [f"Story number {i}: once there was" for i in range(16)]
    params = greedy(16)
    expected = [llm.generate(p, params)[0] for p in prompts]
    gaps: list[float] = []

    async def consume(p: str) -> RequestOutput:
        return check_stream([o async for o in llm.astream(p, params)])

    async def heartbeat(stop: asyncio.Event) -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def main() -> list[RequestOutput]:
        stop = asyncio.Event()
        beat = asyncio.create_task(heartbeat(stop))
        try:
            return await asyncio.gather(*(consume(p) for p in prompts))
        finally:
            stop.set()
            await beat

    got = run_async(main())
    for e, g in zip(expected, got):
        assert ids_of(g) == ids_of(e)
        assert g.outputs[0].text == e.outputs[0].text
    assert gaps and max(gaps) < 2.0, f"the event loop was blocked for {max(gaps):.2f} s while streaming"


def test_cancelling_an_astream_aborts_the_request(llm: LLM, spy: SpyEngine) -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.astream(PROMPT, greedy(200)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_async(main())
    assert len(spy.streams) == 1
    assert_aborted(spy.streams[0], 200)


def test_closing_an_astream_early_aborts_the_request(llm: LLM, spy: SpyEngine) -> None:
    async def main() -> None:
        agen = llm.astream(PROMPT, greedy(200))
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()

    run_async(main())
    assert_aborted(spy.streams[0], 200)


def test_eight_threads_generate_concurrently(llm: LLM) -> None:
    prompts: list[list[str | list[int]]] = [[f"Thread {t} says", [10 + t, 20 + t, 30 + t]] for t in range(8)]
    params = greedy(10)
    expected = [[ids_of(o) for o in llm.generate(ps, params)] for ps in prompts]

    def work(t: int) -> list[list[list[int]]]:
        return [[ids_of(o) for o in llm.generate(prompts[t], params)] for _ in range(3)]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    for t in range(8):
        for got in results[t]:
            assert got == expected[t], f"thread {t}"


# ------------------------------------------------------------------------------------------------
# the same engine as the HTTP server
# ------------------------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def http_token_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def test_greedy_matches_the_http_server(llm: LLM, http_server: Any) -> None:
    prompts = [llm.encode(PROMPT), [5, 6, 7, 8, 9], llm.encode("Hello there, general")]
    for ids in prompts:
        r = post(
            f"{http_server.url}/v1/completions",
            {
                "model": http_server.model_name,
                "prompt": ids,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
        )
        mine = llm.generate([ids], greedy(16))[0].outputs[0]
        assert mine.text == r["choices"][0]["text"]
        assert mine.token_ids == http_token_ids(r["choices"][0])


def test_seeded_sampling_matches_the_http_server(llm: LLM, http_server: Any) -> None:
    ids = llm.encode(PROMPT)
    r = post(
        f"{http_server.url}/v1/completions",
        {"model": http_server.model_name, "prompt": ids, "max_tokens": 12, "temperature": 0.9,
         "top_p": 0.95, "seed": 77, "ignore_eos": True},
    )
    mine = llm.generate([ids], SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True))
    assert mine[0].outputs[0].text == r["choices"][0]["text"]


def test_chat_matches_the_http_server(llm: LLM, http_server: Any) -> None:
    r = post(
        f"{http_server.url}/v1/chat/completions",
        {"model": http_server.model_name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    mine = llm.chat(MESSAGES, greedy(12))[0]
    assert mine.outputs[0].text == r["choices"][0]["message"]["content"]
    assert len(mine.prompt_token_ids) == r["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------
# hub ids
# ------------------------------------------------------------------------------------------------


def test_hub_id_is_resolved_from_the_local_cache(llm: LLM, hub_cache: dict[str, str], subprocess_env: dict[str, str]) -> None:
    code = (
        "import json, rserve\n"
        "llm = rserve.LLM('acme/tiny', max_model_len=256)\n"
        "out = llm.generate([[5, 6, 7, 8]], rserve.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print(json.dumps({'dir': llm.model_dir, 'ids': out[0].outputs[0].token_ids}))\n"
    )
    env = {**subprocess_env, **{k: v for k, v in hub_cache.items() if k.startswith("HF_")}}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["dir"]).resolve() == Path(hub_cache["SNAPSHOT"]).resolve()
    assert got["ids"] == ids_of(llm.generate([[5, 6, 7, 8]], greedy(8))[0])


def test_missing_hub_id_offline_is_reported(hub_cache: dict[str, str], subprocess_env: dict[str, str]) -> None:
    env = {**subprocess_env, **{k: v for k, v in hub_cache.items() if k.startswith("HF_")}}
    r = subprocess.run(
        [sys.executable, "-c", "import rserve; rserve.LLM('acme/missing')"],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert r.returncode != 0
    assert "acme/missing" in r.stderr or "offline" in r.stderr.lower() or "HF_HUB_OFFLINE" in r.stderr


def test_cli_rewrites_hub_ids() -> None:
    fake = {"acme/tiny": "/snap/acme"}.__getitem__
    assert prepare_argv(["serve", "acme/tiny", "--port", "1"], fake) == [
        "serve", "/snap/acme", "--port", "1", "--served-model-name", "acme/tiny",
    ]
    assert prepare_argv(["--log-level", "info", "serve", "--port", "1", "acme/tiny", "--served-model-name", "x"], fake) == [
        "--log-level", "info", "serve", "--port", "1", "/snap/acme", "--served-model-name", "x",
    ]
    assert prepare_argv(["generate", "acme/tiny", "--prompt", "hi"], fake) == ["generate", "/snap/acme", "--prompt", "hi"]
    for flag in ("--enforce-eager", "--no-async-scheduling", "--enable-tokenizer-info-endpoint"):
        assert prepare_argv(["serve", flag, "acme/tiny"], fake)[:3] == ["serve", flag, "/snap/acme"]
    for unchanged in (["serve", str(QWEN2)], ["serve", "--help"], ["bench", "serve", "--model", "acme/tiny"], ["serve"]):
        assert prepare_argv(unchanged, fake) == unchanged


def test_cli_resolves_hub_ids_offline(hub_cache: dict[str, str], subprocess_env: dict[str, str]) -> None:
    env = {**subprocess_env, **{k: v for k, v in hub_cache.items() if k.startswith("HF_")}}
    code = "import json; from rserve.cli import prepare_argv; print(json.dumps(prepare_argv(['serve', 'acme/tiny'])))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    argv = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(argv[1]).resolve() == Path(hub_cache["SNAPSHOT"]).resolve()
    assert argv[2:] == ["--served-model-name", "acme/tiny"]


# ------------------------------------------------------------------------------------------------
# the console script
# ------------------------------------------------------------------------------------------------


def test_console_script_serves_the_openai_client(llm: LLM, script_server: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{script_server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
    try:
        assert [m.id for m in client.models.list().data] == [script_server.model_name]
        chat = client.chat.completions.create(
            model=script_server.model_name, messages=MESSAGES, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].message.content == llm.chat(MESSAGES, greedy(8))[0].outputs[0].text
        chunks = list(
            client.completions.create(
                model=script_server.model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.text for ch in chunks for c in ch.choices)
        assert text == llm.generate(PROMPT, greedy(8))[0].outputs[0].text
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=script_server.model_name, prompt=PROMPT, temperature=-1)
    finally:
        client.close()


def test_console_script_passes_subcommands_through(console_command: list[str], subprocess_env: dict[str, str]) -> None:
    def rserve_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*console_command, *args], env=subprocess_env, capture_output=True, text=True, timeout=TIMEOUT_S
        )

    version = rserve_cli("--version")
    assert version.returncode == 0, version.stderr
    assert "rserve" in version.stdout
    gen = rserve_cli("generate", str(QWEN2), "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos", "--json")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip()
    bad = rserve_cli("no-such-command")
    assert bad.returncode != 0
