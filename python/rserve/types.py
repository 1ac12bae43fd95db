"""Public data types: sampling parameters in, request outputs back (vLLM's names and defaults).

`SamplingParams` checks ranges twice: pydantic field constraints give early, precise errors, and
a final validator hands the whole set to the native parser (`rserve._core.check_params`), the same
code the HTTP server runs, so Python and HTTP accept and reject exactly the same input.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "Logprob",
    "CompletionOutput",
    "RequestOutput",
    "LoRARequest",
]


def _check_params_natively(params_json: str) -> None:
    """Runs the server's parameter parser; raises ValueError("field: message") when invalid."""
    try:
        from rserve import _core
    except ImportError as e:  # a broken install: the native module ships in every wheel
        raise ImportError(
            "rserve's native module (rserve._core) is not available; reinstall rserve "
            "or build it with `maturin develop --release`"
        ) from e
    _core.check_params(params_json)


class StructuredOutputsParams(BaseModel):
    """What the output must match: exactly one of `json` (a JSON schema as a dict or a JSON
    string, or a pydantic model class, whose schema is used), `regex`, `choice`, `grammar` (Lark)
    and `json_object`. JSON is generated compact unless `disable_any_whitespace=False`.

    The grammar is compiled when the request is submitted; an invalid one raises `ValueError`
    there (and a malformed set of fields here).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    json_: Optional[Union[Dict[str, Any], str, bool, type]] = Field(
        default=None, alias="json", description="A JSON schema, or a pydantic model class."
    )
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputsParams:
        j = self.json_
        if isinstance(j, type):
            if not (issubclass(j, BaseModel)):
                raise ValueError("json: a class must be a pydantic model")
            object.__setattr__(self, "json_", j.model_json_schema())
        kinds = [
            self.json_ is not None,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
            bool(self.json_object),
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "exactly one of json, regex, choice, grammar and json_object must be given, "
                f"got {sum(kinds)}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("choice must name at least one string")
        return self

    def to_engine(self) -> Dict[str, Any]:
        """The engine's form (`json` holds the schema itself)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name of `StructuredOutputsParams`."""


class SamplingParams(BaseModel):
    """Per-request sampling and stopping parameters (vLLM's fields and defaults).

    Invalid values raise `ValueError` (a pydantic `ValidationError`) naming the field.
    `max_tokens=None` means "up to the end of the context".
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    n: int = Field(default=1, ge=1, le=128, description="Number of completions returned for the prompt.")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=-1, description="0 or -1 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Minimum probability relative to the top token.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, description="1 disables.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        default=None, description="Token id -> bias in [-100, 100]."
    )
    seed: Optional[int] = Field(
        default=None, ge=-(2**63), le=2**63 - 1, description="Seed of this request's random stream."
    )
    max_tokens: Optional[int] = Field(default=16, ge=1, description="None: up to the end of the context.")
    min_tokens: int = Field(default=0, ge=0)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = Field(default=None, ge=0, le=20, description="Top alternatives per generated token.")
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20, description="Top alternatives per prompt token.")
    structured_outputs: Optional[StructuredOutputsParams] = Field(
        default=None, description="A JSON schema, regex, choice list or grammar the output must match."
    )
    guided_decoding: Optional[StructuredOutputsParams] = Field(
        default=None, exclude=True, description="vLLM's older name of `structured_outputs`."
    )

    @model_validator(mode="after")
    def _check_with_engine(self) -> SamplingParams:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("give structured_outputs or guided_decoding, not both")
            object.__setattr__(self, "structured_outputs", self.guided_decoding)
            object.__setattr__(self, "guided_decoding", None)
        _check_params_natively(self.to_engine_json())
        return self

    def to_engine_json(self, max_tokens: Optional[int] = None) -> str:
        """The JSON the engine receives; `max_tokens` fills in when the field is None."""
        data: Dict[str, Any] = self.model_dump(
            mode="json", exclude_none=True, exclude={"structured_outputs", "guided_decoding"}
        )
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_engine()
        if self.max_tokens is None and max_tokens is not None:
            data["max_tokens"] = max_tokens
        return json.dumps(data, separators=(",", ":"))


class _Output(BaseModel):
    """Base of the output types: tolerant of fields newer engines add."""

    model_config = ConfigDict(extra="ignore")


class Logprob(_Output):
    """The log-probability of one token plus the top alternatives `(token_id, logprob)` there."""

    token_id: int
    logprob: float
    top: List[Tuple[int, float]] = Field(default_factory=list)
    rank: Optional[int] = Field(default=None, description="1 + the number of more likely tokens (prompt logprobs).")


class CompletionOutput(_Output):
    """One completion of a request.

    `text` and `token_ids` are cumulative. `delta` is the text added since the previous snapshot
    of a stream; in the results of `generate`/`chat` it is the whole text.
    """

    index: int
    text: str = ""
    delta: str = ""
    token_ids: List[int] = Field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[List[Logprob]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None

    def finished(self) -> bool:
        """True once the completion has ended (stop, length or abort)."""
        return self.finish_reason is not None


class RequestOutput(_Output):
    """The state of one request: its prompt and its `n` completions."""

    request_id: int
    prompt: Optional[str] = None
    prompt_token_ids: List[int] = Field(default_factory=list)
    prompt_logprobs: Optional[List[Optional[Logprob]]] = None
    outputs: List[CompletionOutput] = Field(default_factory=list)
    finished: bool = False
    queue_time: Optional[float] = None
    #: Prompt tokens found in the prefix cache instead of computed.
    num_cached_tokens: Optional[int] = None


class LoRARequest(BaseModel):
    """A LoRA adapter for a request (vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`).

    The adapter is loaded (read and checked against the base) the first time a request names
    it, and stays registered under `lora_name`; the engine must be built with
    `enable_lora=True`. `lora_path` is a PEFT adapter directory or a hub id.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: int = Field(ge=1, description="vLLM's numeric id; positive.")
    lora_path: str = ""

    def __init__(
        self, lora_name: str, lora_int_id: int, lora_path: str = "", **kwargs: Any
    ) -> None:
        super().__init__(
            lora_name=lora_name, lora_int_id=lora_int_id, lora_path=lora_path, **kwargs
        )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
