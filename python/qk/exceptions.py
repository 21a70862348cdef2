"""The exception tree of qk (defined in the Rust core, re-exported here)."""

from qk._qk import (
    DeviceError,
    DeviceLostError,
    EngineError,
    GgufError,
    InternalError,
    OutOfMemoryError,
    QkError,
    ShaderError,
    TransportError,
    UnsupportedTypeError,
)

__all__ = [
    "DeviceError",
    "DeviceLostError",
    "EngineError",
    "GgufError",
    "InternalError",
    "OutOfMemoryError",
    "QkError",
    "ShaderError",
    "TransportError",
    "UnsupportedTypeError",
]
