"""qk: serve a hybrid MoE model (Qwen3-Next / Qwen3.5 MoE, GGUF) on wgpu, on one GPU or split
into pipeline stages across machines.

Native classes (``Gguf``, ``Engine``…) come from the Rust core ``qk._qk`` and are loaded on first
use, so the pure-Python parts (tokenizer, chat, server helpers) import without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_NATIVE = {
    "QkError",
    "GgufError",
    "UnsupportedTypeError",
    "DeviceError",
    "DeviceLostError",
    "OutOfMemoryError",
    "ShaderError",
    "EngineError",
    "TransportError",
    "InternalError",
    "HeadLink",
    "Worker",
    "adapters",
    "selected_adapter",
}
_PYTHON = {
    "Gguf": "qk.gguf",
    "Engine": "qk.engine",
    "Tokenizer": "qk.tokenizer",
    "TokenizerError": "qk.tokenizer",
    "IncrementalDecoder": "qk.tokenizer",
    "ChatTemplate": "qk.chat",
    "ChatTemplateError": "qk.chat",
    "RenderedPrompt": "qk.chat",
    "ReplyParser": "qk.toolcalls",
    "ToolFormat": "qk.toolcalls",
    "parse_reply": "qk.toolcalls",
    "StopMatcher": "qk.stops",
}

__all__ = sorted(_NATIVE | set(_PYTHON))


def __getattr__(name: str) -> Any:
    if name not in _NATIVE and name not in _PYTHON:
        raise AttributeError(f"module 'qk' has no attribute {name!r}")
    # An attribute this build cannot provide (native core missing or without it) is an AttributeError,
    # so `hasattr(qk, "Engine")` answers False instead of raising; the cause is kept in the message.
    try:
        module = importlib.import_module("qk._qk" if name in _NATIVE else _PYTHON[name])
        return getattr(module, name)
    except ImportError as e:
        raise AttributeError(f"qk.{name} is not available in this build: {e}") from e
