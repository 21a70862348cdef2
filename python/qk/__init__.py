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
    if name in _NATIVE:
        return getattr(importlib.import_module("qk._qk"), name)
    if name in _PYTHON:
        return getattr(importlib.import_module(_PYTHON[name]), name)
    raise AttributeError(f"module 'qk' has no attribute {name!r}")
