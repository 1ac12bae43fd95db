"""rserve: a fast, small LLM serving engine.

The Python package wraps the same engine as the ``rserve`` server binary (module ``rserve._core``)
with vLLM's offline API::

    from rserve import LLM, SamplingParams

    llm = LLM("Qwen/Qwen2.5-0.5B-Instruct")
    out = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

Importing the package is cheap: submodules (pydantic, the native engine) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rserve.llm import LLM
    from rserve.types import (
        CompletionOutput,
        GuidedDecodingParams,
        Logprob,
        LoRARequest,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "__version__",
]

_LAZY = {
    "LLM": "rserve.llm",
    "SamplingParams": "rserve.types",
    "StructuredOutputsParams": "rserve.types",
    "GuidedDecodingParams": "rserve.types",
    "RequestOutput": "rserve.types",
    "CompletionOutput": "rserve.types",
    "Logprob": "rserve.types",
    "LoRARequest": "rserve.types",
}


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("rserve")
    except PackageNotFoundError:
        pass
    try:
        from rserve import _core

        return _core.version()
    except ImportError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "__version__":
        value = _version()
    else:
        raise AttributeError(f"module 'rserve' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
