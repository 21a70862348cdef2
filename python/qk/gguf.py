"""Reading GGUF models: ``Gguf`` wraps the Rust reader (``qk._qk.GgufFile``) with dict metadata,
tensor records and NumPy access to raw and dequantised tensor data.

Example::

    g = qk.Gguf("model.gguf")
    g.arch                                 # "qwen35moe"
    g.metadata["qwen35moe.block_count"]    # 41
    w = g.array("blk.0.attn_norm.weight")  # float32, numpy shape (ne reversed)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from qk import _qk


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model's tensor table."""

    name: str
    type: str  # ggml type name, e.g. "IQ4_XS"
    type_id: int
    ne: tuple[int, ...]  # ggml order: ne[0] is contiguous
    offset: int  # absolute byte offset of the data in its shard file
    nbytes: int
    shard: int  # index into Gguf.shard_paths
    data_offset: int  # offset as stored, relative to the shard's data section

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy (row-major) shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class Gguf:
    """A GGUF model: one file, or the first shard ``NAME-00001-of-0000N.gguf`` of a split model.

    With ``header_only=True`` only metadata and the tensor table are read (the file may be truncated
    after the table); ``raw``/``array`` then raise ``qk.GgufError``. Malformed files raise
    ``qk.GgufError``; a missing file raises ``FileNotFoundError``.
    """

    def __init__(self, path: str | os.PathLike[str], header_only: bool = False) -> None:
        self._native = _qk.GgufFile(os.fspath(path), header_only)
        self.tensors: list[TensorInfo] = [
            TensorInfo(name, ty, type_id, tuple(ne), offset, nbytes, shard, data_offset)
            for (name, ty, type_id, ne, offset, nbytes, shard, data_offset) in self._native.tensors()
        ]
        self._by_name = {t.name: t for t in self.tensors}

    @property
    def path(self) -> str:
        return os.fspath(self._native.path)

    @property
    def shard_paths(self) -> list[str]:
        return [os.fspath(p) for p in self._native.shard_paths]

    @property
    def version(self) -> int:
        return self._native.version

    @property
    def alignment(self) -> int:
        return self._native.alignment

    @property
    def header_only(self) -> bool:
        return self._native.header_only

    @property
    def arch(self) -> str | None:
        """``general.architecture``."""
        return self._native.arch

    @property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of every shard's header and tensor table: equal for the same model file(s)."""
        return self._native.fingerprint

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Metadata in file order (built once: tokenizer arrays are large)."""
        return self._native.metadata()

    def tensor(self, name: str) -> TensorInfo:
        """The tensor record; ``KeyError`` if there is none of that name."""
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self.tensors)

    def raw(self, name: str) -> np.ndarray:
        """A copy of the tensor's bytes (uint8, 1-D)."""
        return self._native.raw(name)

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in NumPy shape (``ne`` reversed)."""
        return self._native.dequantize(name).reshape(self.tensor(name).shape)

    def __repr__(self) -> str:
        return f"Gguf({self.path!r}, arch={self.arch!r}, tensors={len(self)})"
