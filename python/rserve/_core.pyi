"""The native engine (Rust). Use `rserve.LLM` rather than this module directly."""

from __future__ import annotations

def version() -> str:
    """The version of the native module."""

def check_params(params_json: str) -> str:
    """Validates sampling parameters (a JSON object) with the HTTP server's parser and range
    checks; raises ValueError("field: message") when invalid; returns the JSON unchanged."""

def default_model() -> tuple[str, str]:
    """The embedded default model: its directory (written on first use) and its served name."""

def serve(argv: list[str]) -> None:
    """Runs the `rserve` command line in-process (e.g. ["serve", MODEL, "--port", "8000"]) with
    the GIL released; returns when the command ends."""

class Engine:
    """A loaded model plus its scheduler, running in native threads."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        chat_template: str | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        isq: str | None = None,
        isq_lm_head: bool = False,
        tokenizer: str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        limit_mm_per_prompt: int | None = None,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
    ) -> None:
        """Loads a local model directory. ValueError on a bad configuration, RuntimeError (naming
        the file and reason) when loading fails."""

    @property
    def model_dir(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def kv_cache_tokens(self) -> int: ...
    @property
    def kv_cache_dtype(self) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def chat_prompt(
        self, messages_json: str, add_generation_prompt: bool = True, tools_json: str | None = None
    ) -> list[int]:
        """Token ids of a conversation (JSON list of {"role", "content"}) rendered with the chat
        template; ValueError on bad messages or template errors."""

    def chat_images(self, messages_json: str) -> list[bytes]:
        """The encoded images of a conversation's `image_url` parts (data: URIs or http(s)
        URLs), in order; ValueError for a bad URL, a failed fetch or a model without vision."""

    def submit(
        self,
        prompt: str | list[int],
        params_json: str,
        lora: str | None = None,
        images: list[bytes] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Starts a request, with the LoRA adapter registered as `lora` when given. Text prompts
        are tokenized with special tokens. `images` (encoded PNG, JPEG, WebP or GIF) fill the
        prompt's image placeholders in order. Only requests of the same `cache_salt` share cached
        prefix blocks. ValueError for invalid parameters, an empty prompt, one over the context
        length, an adapter name that is not registered, an empty salt, or images that are
        invalid, do not match the placeholders or are given to a text-only model."""

    def load_lora(self, name: str, path: str) -> int:
        """Registers a LoRA adapter (a PEFT directory or hub id), read and checked now; returns
        its engine id. ValueError when the name is taken, adapters are off or the adapter cannot
        be used (the message names the adapter and the reason)."""

    def unload_lora(self, name: str) -> int:
        """Unregisters an adapter (requests using it finish with it); ValueError when unknown."""

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix block; returns how many blocks were cached."""

    def lora_adapters(self) -> list[tuple[str, str]]:
        """The registered adapters: (name, path)."""

    def http_app(
        self,
        served_model_name: str,
        *,
        api_key: str | None = None,
        tool_call_parser: str | None = None,
    ) -> HttpApp:
        """The server's router (every OpenAI route) over this engine; ValueError for an unknown
        tool call parser or an empty name."""

    def shutdown(self) -> None: ...

class HttpApp:
    """`rserve serve`'s routes called in-process, request by request (the same parsing, errors,
    streaming and metrics)."""

    def start(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> HttpResponse:
        """Starts one request (path with its query string) and returns at once. ValueError for
        a malformed method, path or header."""

class HttpResponse:
    """A request in flight; dropping it (or `close`) before the end aborts its generation."""

    def head(self, timeout_s: float) -> tuple[int, list[tuple[str, str]]] | None:
        """(status, headers), or None when they did not come within `timeout_s`."""

    def next_chunk(self, timeout_s: float) -> bytes | None:
        """The next body chunk (after `head`), None when none came within `timeout_s`;
        StopIteration at the end."""

    def close(self) -> None:
        """Drops the rest of the response (aborts a streamed generation)."""

class RequestStream:
    """The outputs of one request, as JSON of `RequestDelta`s (what is new: text, token ids,
    logprobs, the finish); the last has `finished`. Deltas not taken yet are merged into one."""

    @property
    def request_id(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    def __iter__(self) -> RequestStream: ...
    def __next__(self) -> str:
        """The next delta (waits with the GIL released; Ctrl-C raises KeyboardInterrupt)."""

    def next_timeout(self, timeout_s: float) -> str | None:
        """The next delta, or None when nothing arrived within `timeout_s`; raises
        StopIteration after the final one and ValueError for a NaN timeout."""

    def result(self) -> str:
        """Waits for the end and returns the assembled `RequestOutput` as JSON (the deltas
        taken before count too)."""

    def abort(self) -> None:
        """Aborts the request (also done when the object is dropped unfinished)."""
