"""`LLM`: the engine in-process, with vLLM's offline API (`generate`, `chat`) plus sync and async
streaming iterators that abort their request when dropped.

All engine work happens in native threads; every blocking wait releases the GIL, so several
Python threads (or asyncio tasks, through `astream`) can drive one `LLM` at once and their
requests are batched together.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncGenerator, Generator, Union, cast

from rserve._prompts import (
    Conversation,
    ParamsArg,
    Prompt,
    _Extras,
    _as_params,
    _extras_of,
    _image_limit,
    _is_conversation,
    _messages_json,
    _normalize_one,
    _normalize_prompts,
    _per_prompt,
    _prompt_list,
    _text_of,
)
from rserve.types import CompletionOutput, Logprob, LoRARequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from rserve._core import Engine, RequestStream

__all__ = ["LLM", "resolve_model", "is_hub_id", "HUB_ALLOW_PATTERNS"]

# a prompt to submit: the prompt, its text (when given as text) and its encoded images
_Job = tuple[Prompt, Union[str, None], _Extras]
LoraArg = Union[LoRARequest, None]

#: Files fetched from the hub: configs, weights, tokenizer files and chat templates.
HUB_ALLOW_PATTERNS: list[str] = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]

_HUB_PART = re.compile(r"^[A-Za-z0-9_.-]+$")
_POLL_S = 0.05  # how long one async poll waits in a worker thread
_DRAIN_MAX = 64  # outputs one poll hands back at most
_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()
_ENGINE_KWARGS = frozenset(
    {
        "max_num_batched_tokens",
        "block_size",
        "chat_template",
        "gpu_memory_utilization",
        "enforce_eager",
        "async_scheduling",
        "isq",
        "isq_lm_head",
        "tokenizer",
        "quantization",
        "kv_cache_dtype",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "enable_prefix_caching",
        "tensor_parallel_size",
        "limit_mm_per_prompt",
        "allowed_local_media_path",
        "allowed_media_domains",
    }
)


# ------------------------------------------------------------------------------------------------
# model resolution
# ------------------------------------------------------------------------------------------------


def is_hub_id(spec: str) -> bool:
    """True for `org/name` (optionally `@revision`), the hub ids the server also accepts."""
    repo = spec.split("@", 1)[0]
    parts = repo.split("/")
    return len(parts) == 2 and all(p not in (".", "..") and _HUB_PART.match(p) for p in parts)


def resolve_model(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> str:
    """A local model directory or GGUF file as is, or a hub id (`org/name[@revision]`) resolved to
    its snapshot directory in the Hugging Face cache, downloading what is missing (with progress
    bars).

    Honours `HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN`.
    """
    spec = os.fspath(model)
    path = os.path.expanduser(spec)
    if os.path.isdir(path) or (os.path.isfile(path) and path.lower().endswith(".gguf")):
        return os.path.abspath(path)
    if not is_hub_id(spec):
        raise FileNotFoundError(
            f"model `{spec}` is neither a local directory, a GGUF file nor a Hugging Face hub id "
            "(org/name)"
        )
    repo_id, _, rev = spec.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ImportError(
            f"loading `{spec}` from the Hugging Face hub needs huggingface_hub "
            "(pip install huggingface-hub), or pass a local model directory"
        ) from e
    return str(
        snapshot_download(
            repo_id,
            revision=revision or rev or None,
            cache_dir=download_dir,
            token=token,
            allow_patterns=HUB_ALLOW_PATTERNS,
        )
    )


# ------------------------------------------------------------------------------------------------
# output assembly
# ------------------------------------------------------------------------------------------------


class _Assembler:
    """Assembles the deltas of one request (JSON from the engine) into `RequestOutput`s with
    every completion present. Each delta costs time in its own size; each `RequestOutput` built
    copies the lists so far (the engine merges deltas a slow reader has not taken yet)."""

    def __init__(
        self, prompt: str | None, n: int, prompt_token_ids: list[int], logprobs: bool = False
    ) -> None:
        self.prompt = prompt
        self.n = n
        self.request_id = -1
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.queue_time: float | None = None
        self.num_cached_tokens: int | None = None
        self.finished = False
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[Logprob] | None] = [[] if logprobs else None for _ in range(n)]
        self.cumulative: list[float | None] = [0.0] * n
        self.finish: list[str | None] = [None] * n
        self.stop: list[int | str | None] = [None] * n

    def update(self, raw: str) -> RequestOutput:
        """Takes one delta; returns the assembled state, each `delta` the text this one added."""
        data = json.loads(raw)
        self.request_id = data["request_id"]
        if data.get("queue_time") is not None:
            self.queue_time = data["queue_time"]
        if data.get("num_cached_tokens") is not None:
            self.num_cached_tokens = data["num_cached_tokens"]
        for entry in data.get("prompt_logprobs") or []:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.append(None if entry is None else _logprob(entry))
        self.finished = bool(data.get("finished"))
        fresh: dict[int, str] = {}
        for out in data.get("outputs") or []:
            i = out["index"]
            if i >= self.n:
                continue
            text = out.get("text", "")
            fresh[i] = text
            self.texts[i].append(text)
            self.tokens[i].extend(out.get("token_ids") or [])
            if out.get("logprobs"):
                lps = self.logprobs[i]
                if lps is None:
                    lps = self.logprobs[i] = []
                lps.extend(_logprob(e) for e in out["logprobs"])
            self.cumulative[i] = out.get("cumulative_logprob")
            self.finish[i] = out.get("finish_reason") or self.finish[i]
            if out.get("stop_reason") is not None:
                self.stop[i] = out["stop_reason"]
        return self._build(lambda i: fresh.get(i, ""))

    def _build(self, delta_of: Any) -> RequestOutput:
        outputs = []
        for i in range(self.n):
            text = "".join(self.texts[i])
            self.texts[i] = [text]
            lps = self.logprobs[i]
            outputs.append(
                CompletionOutput.model_construct(
                    index=i,
                    text=text,
                    delta=delta_of(i),
                    token_ids=list(self.tokens[i]),
                    cumulative_logprob=self.cumulative[i],
                    logprobs=None if lps is None else list(lps),
                    finish_reason=self.finish[i],
                    stop_reason=self.stop[i],
                )
            )
        return RequestOutput.model_construct(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            outputs=outputs,
            finished=self.finished,
            queue_time=self.queue_time,
            num_cached_tokens=self.num_cached_tokens,
        )

    def final(self, raw: str) -> RequestOutput:
        """A finished request's whole output (JSON of the engine's assembled output): each
        `delta` is the whole text, as in vLLM's offline results."""
        data = json.loads(raw)
        outputs = [
            CompletionOutput.model_validate({**o, "delta": o.get("text", "")})
            for o in data.get("outputs") or []
        ]
        return RequestOutput.model_validate({**data, "prompt": self.prompt, "outputs": outputs})


def _logprob(entry: Mapping[str, Any]) -> Logprob:
    return Logprob.model_construct(
        token_id=entry["token_id"],
        logprob=entry["logprob"],
        top=[(t, lp) for t, lp in entry.get("top") or []],
        rank=entry.get("rank"),
    )


def _abort_quietly(stream: RequestStream) -> None:
    """Aborts a request during cleanup without masking the error being handled."""
    try:
        stream.abort()
    except Exception:  # noqa: BLE001 - cleanup must not replace the original exception
        pass


def _executor() -> ThreadPoolExecutor:
    """The worker threads that wait on native streams for `astream` (created on first use)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rserve-astream")
        return _EXECUTOR


_END = object()


def _poll(stream: RequestStream) -> list[Any]:
    """In a worker: waits up to `_POLL_S` for an output, then drains what else is ready.
    Returns JSON strings, ending with `_END` once the stream is over."""
    got: list[Any] = []
    try:
        first = stream.next_timeout(_POLL_S)
        if first is None:
            return got
        got.append(first)
        while len(got) < _DRAIN_MAX:
            more = stream.next_timeout(0.0)
            if more is None:
                break
            got.append(more)
    except StopIteration:
        got.append(_END)
    return got


# ------------------------------------------------------------------------------------------------
# LLM
# ------------------------------------------------------------------------------------------------


class LLM:
    """An engine loaded in this process (vLLM's offline API).

    `model` is a local directory in Hugging Face layout, a GGUF file (config, tokenizer and chat
    template from its metadata; its quantized tensors served as stored) or a hub id
    (`org/name`), downloaded into the Hugging Face cache when missing. Extra keyword arguments: `max_num_batched_tokens`,
    `block_size`, `chat_template` (a file or inline Jinja replacing the model's template),
    `gpu_memory_utilization`, `enforce_eager` (no CUDA graphs of decode steps),
    `async_scheduling` (default on: on a GPU the next step is issued while the current one runs),
    `isq` (quantize the decoder's projections while loading: `q8_0`, `q4_0`, `q4k`, `q6k`,
    `fp8`), `quantization` (vLLM's spelling of `isq="fp8"`), `isq_lm_head` (with `isq`, the
    output head too), `tokenizer` (a directory whose `tokenizer.json` replaces the model's),
    `kv_cache_dtype` (`"auto"` or `"fp8"`: an FP8 E4M3 KV cache holding twice the tokens),
    `enable_lora` (serve LoRA adapters: pass `lora_request=LoRARequest(name, int_id, path)` to
    `generate`, `chat`, `stream` and `astream`), `max_loras` (adapters on the device at once),
    `max_lora_rank`, `max_cpu_loras` (adapters kept in host memory), `enable_prefix_caching`
    (default on: prompts start from the longest run of cached KV blocks of earlier requests;
    `RequestOutput.num_cached_tokens` says how many tokens that skipped),
    `tensor_parallel_size` (split the model over this many GPUs: one thread per GPU, NCCL),
    and for vision models vLLM's media settings: `limit_mm_per_prompt` (`{"image": N}`: at most N
    images a prompt, 8 by default), `allowed_local_media_path` (`file://` image URLs in `chat`
    only under this directory; refused without it) and `allowed_media_domains` (`http(s)://`
    image URLs only from these hosts).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory: int | None = None,
        seed: int = 0,
        *,
        revision: str | None = None,
        download_dir: str | None = None,
        hf_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_KWARGS)
        if unknown:
            raise TypeError(
                f"LLM() got unsupported arguments: {', '.join(unknown)} "
                f"(supported extras: {', '.join(sorted(_ENGINE_KWARGS))})"
            )
        if "limit_mm_per_prompt" in kwargs:
            kwargs["limit_mm_per_prompt"] = _image_limit(kwargs["limit_mm_per_prompt"])
        for key in ("allowed_local_media_path",):
            if kwargs.get(key) is not None:
                kwargs[key] = os.fspath(kwargs[key])
        if kwargs.get("allowed_media_domains") is not None:
            kwargs["allowed_media_domains"] = list(kwargs["allowed_media_domains"])
        template = kwargs.get("chat_template")
        if isinstance(template, (str, os.PathLike)) and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                kwargs["chat_template"] = f.read()
        model_dir = resolve_model(model, revision=revision, download_dir=download_dir, token=hf_token)
        from rserve._core import Engine

        self.model = os.fspath(model)
        self._loras: dict[str, tuple[int, str]] = {}
        self._lora_lock = threading.Lock()
        self._engine: Engine = Engine(
            model_dir,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory=kv_cache_memory,
            seed=seed,
            **kwargs,
        )

    # -- facts and tokenizer ---------------------------------------------------------------------

    @property
    def model_dir(self) -> str:
        """The directory the weights were loaded from."""
        return self._engine.model_dir

    @property
    def max_model_len(self) -> int:
        """The context length (prompt plus completion) in tokens."""
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (all sequences together)."""
        return self._engine.kv_cache_tokens

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores: `auto` (the model's dtype) or `fp8_e4m3`."""
        return self._engine.kv_cache_dtype

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the model's special tokens unless told otherwise)."""
        return self._engine.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._engine.decode(list(ids), skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Conversation,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of one conversation rendered with the model's chat template; `tools` (OpenAI's
        `{"type": "function", "function": {...}}` objects) reach the template as `tools`."""
        tools_json = None if tools is None else json.dumps(list(tools))
        return self._engine.chat_prompt(_messages_json(messages), add_generation_prompt, tools_json)

    # -- offline API -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Mapping[str, Any] | Sequence[Prompt | Mapping[str, Any]],
        sampling_params: ParamsArg | Sequence[ParamsArg] = None,
        lora_request: LoraArg | Sequence[LoraArg] = None,
    ) -> list[RequestOutput]:
        """Completes each prompt; returns one `RequestOutput` per prompt, in input order.

        `prompts` is a string, a list of strings, a list of token ids (one prompt), a list of
        token-id lists, or vLLM's `{"prompt": ...}` / `{"prompt_token_ids": [...]}` dicts.
        `sampling_params` is one `SamplingParams` for all or a list with one per prompt; without
        it the model's generation defaults apply. `lora_request` is one `LoRARequest` for all
        prompts or a list with one (or None) per prompt. All prompts are submitted before any
        result is awaited, so they are batched together.
        """
        items = _normalize_prompts(prompts)
        raw = _prompt_list(prompts)
        extras = [_extras_of(r) for r in raw] if len(raw) == len(items) else [_Extras([]) for _ in items]
        params = _per_prompt(sampling_params, len(items))
        loras = self._per_prompt_lora(lora_request, len(items))
        jobs: list[_Job] = [(p, p if isinstance(p, str) else None, e) for p, e in zip(items, extras)]
        return self._run(jobs, params, loras)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: ParamsArg | Sequence[ParamsArg] = None,
        add_generation_prompt: bool = True,
        lora_request: LoraArg | Sequence[LoraArg] = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of messages) or each of a list of conversations.

        Each conversation is rendered with the model's chat template (with `tools`, OpenAI-style
        function definitions, when given); `prompt` in the results is the rendered text.
        """
        if _is_conversation(messages):
            conversations = [cast(Conversation, messages)]
        else:
            conversations = list(cast(Sequence[Conversation], messages))
        params = _per_prompt(sampling_params, len(conversations))
        loras = self._per_prompt_lora(lora_request, len(conversations))
        jobs: list[_Job] = []
        for conv in conversations:
            ids = self.apply_chat_template(conv, add_generation_prompt, tools)
            images = self._engine.chat_images(_messages_json(conv))
            jobs.append((ids, self._engine.decode(ids, False), _Extras(images)))
        return self._run(jobs, params, loras)

    # -- LoRA adapters ---------------------------------------------------------------------------

    def _lora_name(self, req: LoRARequest | None) -> str | None:
        """The engine's name for a request's adapter, loading it the first time it is named."""
        if req is None:
            return None
        if not isinstance(req, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        with self._lora_lock:
            known = self._loras.get(req.lora_name)
            if known is not None:
                if known[0] != req.lora_int_id or (req.lora_path and known[1] != req.lora_path):
                    raise ValueError(
                        f"lora_request: adapter `{req.lora_name}` is already loaded as "
                        f"id {known[0]} from {known[1]!r}"
                    )
                return req.lora_name
            registered = dict(self._engine.lora_adapters())
            if req.lora_name not in registered:
                if not req.lora_path:
                    raise ValueError(f"lora_request: adapter `{req.lora_name}` needs a lora_path")
                self._engine.load_lora(req.lora_name, req.lora_path)
            self._loras[req.lora_name] = (req.lora_int_id, req.lora_path or registered[req.lora_name])
            return req.lora_name

    def _per_prompt_lora(
        self, lora: LoraArg | Sequence[LoraArg], count: int
    ) -> list[str | None]:
        if lora is None or isinstance(lora, LoRARequest):
            name = self._lora_name(lora)
            return [name] * count
        items = list(lora)
        if len(items) != count:
            raise ValueError(
                f"lora_request: {len(items)} given for {count} prompts; give one for all or one per prompt"
            )
        return [self._lora_name(r) for r in items]

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix block (requests in flight keep theirs); returns how many
        blocks were cached."""
        return self._engine.reset_prefix_cache()

    def unload_lora(self, lora_name: str) -> None:
        """Unregisters an adapter; requests already running with it finish with it."""
        with self._lora_lock:
            self._engine.unload_lora(lora_name)
            self._loras.pop(lora_name, None)

    def _run(
        self,
        jobs: list[_Job],
        params: list[SamplingParams | None],
        loras: list[str | None],
    ) -> list[RequestOutput]:
        """Submits every job, then collects each to its end (aborting the rest on any error)."""
        started: list[tuple[RequestStream, _Assembler]] = []
        done = 0
        try:
            for (prompt, text, extras), p, lora in zip(jobs, params, loras):
                started.append(self._submit(prompt, text, p, lora, extras))
            results = []
            for stream, asm in started:
                results.append(asm.final(stream.result()))
                done += 1
            return results
        finally:
            for stream, _ in started[done:]:
                _abort_quietly(stream)

    def _submit(
        self,
        prompt: Prompt,
        text: str | None,
        params: SamplingParams | None,
        lora: str | None = None,
        extras: _Extras | None = None,
    ) -> tuple[RequestStream, _Assembler]:
        """Starts one request; returns its native stream and an assembler for its outputs."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            native: str | list[int] = prompt
        else:
            native = list(prompt)
            if not native:
                raise ValueError("prompt: must not be empty")
        logprobs = params is not None and params.logprobs is not None
        if params is None:
            params_json, n = "{}", 1
        else:
            fill = None
            if params.max_tokens is None:
                ids = native if isinstance(native, list) else self.encode(native)
                fill = max(1, self.max_model_len - len(ids))
            params_json, n = params.to_engine_json(fill), params.n
        extras = extras or _Extras([])
        stream = self._engine.submit(
            native, params_json, lora, extras.images or None, cache_salt=extras.cache_salt
        )
        return stream, _Assembler(text, n, stream.prompt_token_ids, logprobs)

    # -- streaming -------------------------------------------------------------------------------

    def stream(
        self, prompt: Prompt, sampling_params: ParamsArg = None, lora_request: LoraArg = None
    ) -> Generator[RequestOutput, None, None]:
        """Streams one prompt: yields `RequestOutput`s whose `outputs[i].text` grows (with the new
        part in `delta`); the last has `finished=True`. The request is submitted at once (so bad
        input raises here); leaving the loop early aborts it.
        """
        params = _as_params(sampling_params)
        lora = self._lora_name(lora_request)
        stream, asm = self._submit(
            _normalize_one(prompt), _text_of(prompt), params, lora, _extras_of(prompt)
        )
        return _iterate(stream, asm)

    async def astream(
        self, prompt: Prompt, sampling_params: ParamsArg = None, lora_request: LoraArg = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """`stream` for asyncio: never blocks the event loop (waits happen in worker threads);
        cancelling the consuming task, or closing the iterator early, aborts the request.
        """
        params = _as_params(sampling_params)
        loop = asyncio.get_running_loop()
        lora = await loop.run_in_executor(_executor(), self._lora_name, lora_request)
        submitted: Future[tuple[RequestStream, _Assembler]] = _executor().submit(
            self._submit, _normalize_one(prompt), _text_of(prompt), params, lora, _extras_of(prompt)
        )
        try:
            stream, asm = await asyncio.wrap_future(submitted, loop=loop)
        except asyncio.CancelledError:
            submitted.add_done_callback(_abort_submitted)
            raise
        finished = False
        pending: Future[list[Any]] | None = None
        try:
            while not finished:
                pending = _executor().submit(_poll, stream)
                batch = await asyncio.wrap_future(pending, loop=loop)
                pending = None
                for raw in batch:
                    if raw is _END:
                        finished = True
                        break
                    out = asm.update(raw)
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                if pending is not None and not pending.done():
                    # A worker is inside the stream's wait; abort once it is out.
                    pending.add_done_callback(lambda _f: _abort_quietly(stream))
                else:
                    _abort_quietly(stream)

    async def agenerate(
        self, prompt: Prompt, sampling_params: ParamsArg = None, lora_request: LoraArg = None
    ) -> RequestOutput:
        """Completes one prompt without blocking the event loop; returns the final output."""
        last: RequestOutput | None = None
        async for out in self.astream(prompt, sampling_params, lora_request):
            last = out
        if last is None:
            raise RuntimeError("the engine ended the request without an output")
        return _finalize(last)

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the engine; requests still running end."""
        self._engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"LLM(model={self.model!r}, max_model_len={self.max_model_len})"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _iterate(stream: RequestStream, asm: _Assembler) -> Generator[RequestOutput, None, None]:
    finished = False
    try:
        for raw in stream:
            out = asm.update(raw)
            finished = out.finished
            yield out
        finished = True
    finally:
        if not finished:
            _abort_quietly(stream)


def _abort_submitted(f: Future[tuple[RequestStream, _Assembler]]) -> None:
    """Aborts a request whose submission finished after its caller was cancelled."""
    if not f.cancelled() and f.exception() is None:
        _abort_quietly(f.result()[0])


def _finalize(out: RequestOutput) -> RequestOutput:
    """A streamed snapshot as a final result: each `delta` becomes the whole text."""
    return out.model_copy(
        update={"outputs": [o.model_copy(update={"delta": o.text}) for o in out.outputs]}
    )
