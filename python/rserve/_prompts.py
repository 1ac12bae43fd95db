"""What `LLM` takes as prompts, turned into what the engine takes: text or token ids, prompt
dicts with images (bytes, PIL images, data URIs) and vLLM's `cache_salt`, chat conversations as
JSON, sampling parameters per prompt, and the image limit of `limit_mm_per_prompt`."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union, cast

from rserve.types import SamplingParams

#: A prompt: text (tokenized with the model's special tokens) or token ids.
Prompt = Union[str, Sequence[int]]
#: One chat conversation: a list of {"role", "content"} messages.
Conversation = Sequence[Mapping[str, Any]]
ParamsArg = Union[SamplingParams, Mapping[str, Any], None]


class _Extras(NamedTuple):
    """What a prompt dict carries beside its prompt: images and vLLM's prefix-cache salt."""

    images: list[bytes]
    cache_salt: str | None = None


def _is_token_ids(x: object) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    )


def _normalize_one(p: object) -> Prompt:
    """One prompt as text or a list of token ids."""
    if isinstance(p, str):
        return p
    if isinstance(p, Mapping):
        if "prompt_token_ids" in p:
            return _normalize_one(list(p["prompt_token_ids"]))
        if "prompt" in p:
            return _normalize_one(p["prompt"])
        raise TypeError("a prompt dict needs `prompt` or `prompt_token_ids`")
    if _is_token_ids(p):
        return list(cast(Sequence[int], p))
    raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")


def _image_bytes(img: object) -> bytes:
    """An image as encoded bytes: bytes as given, a PIL image saved as PNG."""
    if isinstance(img, (bytes, bytearray, memoryview)):
        return bytes(img)
    save = getattr(img, "save", None)
    if callable(save):
        buf = io.BytesIO()
        save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be a PIL.Image or encoded bytes, got {type(img).__name__}")


def _images_of(p: object) -> list[bytes]:
    """The images of a `{"prompt": ..., "multi_modal_data": {"image": ...}}` prompt."""
    if not isinstance(p, Mapping):
        return []
    data = p.get("multi_modal_data")
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise TypeError("multi_modal_data must be a dict such as {\"image\": [...]}")
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: only `image` is supported, got {sorted(unknown)}")
    images = data.get("image")
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [_image_bytes(i) for i in images]
    return [_image_bytes(images)]


def _image_limit(limit: object) -> int | None:
    """vLLM's `limit_mm_per_prompt` (`{"image": N}`, or N) as the image count."""
    if limit is None:
        return None
    if isinstance(limit, Mapping):
        # as `--limit-mm-per-prompt`: the image count is required, other modalities (not
        # served) may carry counts that do not matter
        for key, n in limit.items():
            if key != "image" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"limit_mm_per_prompt: `{key}` must be a count, got {n!r}")
        if "image" not in limit:
            raise ValueError("limit_mm_per_prompt: expected an `image` count")
        limit = limit["image"]
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt: the image limit must be a count, got {limit!r}")
    return limit


def _extras_of(p: object) -> _Extras:
    """The images and the `cache_salt` of a prompt dict (vLLM's `TextPrompt` / `TokensPrompt`
    field: only prompts of the same salt share cached prefix blocks)."""
    images = _images_of(p)
    salt = p.get("cache_salt") if isinstance(p, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt: must be a non-empty string")
    return _Extras(images, salt)


def _prompt_list(prompts: object) -> list[object]:
    """The prompt objects `_normalize_prompts` reads, one per prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and not (len(prompts) and _is_token_ids(prompts)):
        return list(prompts)
    return [prompts]


def _text_of(p: object) -> str | None:
    if isinstance(p, str):
        return p
    if isinstance(p, Mapping) and "prompt_token_ids" not in p:
        text = p.get("prompt")
        return text if isinstance(text, str) else None
    return None


def _normalize_prompts(prompts: object) -> list[Prompt]:
    """`generate`'s prompt argument as a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return [_normalize_one(prompts)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if len(prompts) and _is_token_ids(prompts):
        return [list(prompts)]
    return [_normalize_one(p) for p in prompts]


def _as_params(p: ParamsArg) -> SamplingParams | None:
    if p is None or isinstance(p, SamplingParams):
        return p
    if isinstance(p, Mapping):
        return SamplingParams(**p)
    raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")


def _per_prompt(params: ParamsArg | Sequence[ParamsArg], count: int) -> list[SamplingParams | None]:
    """One parameter set per prompt."""
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return [_as_params(params)] * count
    items = list(params)
    if len(items) != count:
        raise ValueError(
            f"sampling_params: got {len(items)} parameter sets for {count} prompts; "
            "pass one SamplingParams or one per prompt"
        )
    return [_as_params(p) for p in items]


def _is_conversation(x: object) -> bool:
    """True for one conversation (a list of message dicts), False for a list of them."""
    if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
        raise TypeError("messages must be a list of message dicts or a list of such lists")
    return len(x) == 0 or isinstance(x[0], Mapping)


def _jsonable(o: object) -> Any:
    dump = getattr(o, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    raise TypeError(f"cannot send a {type(o).__name__} as part of a chat message")


def _pil_parts(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message whose `image_pil` parts (PIL images) are turned into `image_url` data URIs."""
    content = message.get("content")
    if not isinstance(content, list) or not any(
        isinstance(p, Mapping) and p.get("type") == "image_pil" for p in content
    ):
        return message
    parts = []
    for p in content:
        if isinstance(p, Mapping) and p.get("type") == "image_pil":
            b64 = base64.b64encode(_image_bytes(p.get("image_pil"))).decode()
            parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}})
        else:
            parts.append(p)
    return {**message, "content": parts}


def _messages_json(messages: Conversation) -> str:
    return json.dumps([_pil_parts(m) for m in messages], default=_jsonable)
