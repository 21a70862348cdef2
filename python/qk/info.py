"""``python -m qk.info MODEL.gguf``: what a GGUF model holds — architecture, layer plan (Gated
DeltaNet vs full attention, MTP layers), key hyperparameters, per-layer and per-type tensor sizes,
and whether qk can load every tensor type in it.

Layer rule (docs/numerics.md "Layer plan"): for the hybrid architectures, layer i of the main stack is
recurrent (Gated DeltaNet) iff ``(i + 1) % full_attention_interval != 0`` (interval default 4)
unless ``{arch}.attention.recurrent_layers`` lists it; the last ``nextn_predict_layers`` blocks
are MTP layers, never run by the main forward pass.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from qk import _qk
from qk.gguf import Gguf, TensorInfo

HYBRID_ARCHS = {"qwen3next", "qwen35moe", "qwen35"}
DEFAULT_FULL_ATTENTION_INTERVAL = 4

# (key under "{arch}.", label) for the hyperparameters worth seeing at a glance (docs/numerics.md "Metadata").
HYPERPARAMETERS = [
    ("context_length", "context length"),
    ("embedding_length", "n_embd"),
    ("feed_forward_length", "dense FFN width"),
    ("attention.head_count", "attention heads"),
    ("attention.head_count_kv", "KV heads"),
    ("attention.key_length", "head dim (k)"),
    ("attention.value_length", "head dim (v)"),
    ("attention.layer_norm_rms_epsilon", "RMSNorm eps"),
    ("rope.freq_base", "RoPE base"),
    ("rope.dimension_count", "RoPE dims"),
    ("rope.dimension_sections", "M-RoPE sections"),
    ("expert_count", "experts"),
    ("expert_used_count", "experts per token"),
    ("expert_feed_forward_length", "expert FFN width"),
    ("expert_shared_feed_forward_length", "shared expert FFN width"),
    ("ssm.conv_kernel", "GDN conv taps"),
    ("ssm.state_size", "GDN head dim"),
    ("ssm.group_count", "GDN k heads"),
    ("ssm.time_step_rank", "GDN v heads"),
    ("ssm.inner_size", "GDN inner size"),
    ("full_attention_interval", "full attention every"),
]

KIND_NAMES = {"deltanet": "Gated DeltaNet", "attention": "full attention", "mtp": "MTP (full attention)"}
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def layer_kinds(metadata: dict[str, Any], arch: str) -> list[str]:
    """Kind of each block: "deltanet", "attention" or "mtp" ("layer" for non-hybrid archs)."""
    n_blocks = int(metadata.get(f"{arch}.block_count", 0))
    n_mtp = int(metadata.get(f"{arch}.nextn_predict_layers", 0))
    n_main = n_blocks - n_mtp
    recurrent = metadata.get(f"{arch}.attention.recurrent_layers")
    interval = metadata.get(f"{arch}.full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    kinds = []
    for i in range(n_blocks):
        if i >= n_main:
            kinds.append("mtp")
        elif arch not in HYBRID_ARCHS:
            kinds.append("layer")
        elif isinstance(recurrent, list) and i < len(recurrent):
            kinds.append("deltanet" if recurrent[i] else "attention")
        elif not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{arch}.full_attention_interval = {interval!r} is not a positive integer")
        else:
            kinds.append("deltanet" if (i + 1) % interval != 0 else "attention")
    return kinds


def ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 4, 5] → "0-2, 4-5"."""
    parts: list[str] = []
    start = prev = None
    for i in [*indices, None]:
        if start is not None and (i is None or i != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(parts)


def summarize(g: Gguf) -> str:
    m = g.metadata
    arch = g.arch or "?"
    out: list[str] = []
    shards = g.shard_paths
    out.append(f"file: {g.path}" + (f" ({len(shards)} shards)" if len(shards) > 1 else ""))
    out.append(f"GGUF v{g.version}, alignment {g.alignment}, fingerprint {g.fingerprint[:16]}")
    if g.header_only:
        out.append("data: absent (header only)")
    name = m.get("general.name")
    out.append(f"architecture: {arch}" + (f" ({name})" if name else ""))

    kinds = layer_kinds(m, arch)
    n_mtp = kinds.count("mtp")
    out.append(f"layers: {len(kinds)} blocks = {len(kinds) - n_mtp} main + {n_mtp} MTP")
    for kind in ("deltanet", "attention", "mtp", "layer"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx and kind != "layer":
            out.append(f"  {KIND_NAMES[kind]:<22} {len(idx):>3}: {ranges(idx)}")

    tokens = m.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else None
    if vocab is None and "token_embd.weight" in g and len(g.tensor("token_embd.weight").ne) > 1:
        vocab = g.tensor("token_embd.weight").ne[1]
    out.append("hyperparameters:")
    if vocab is not None:
        out.append(f"  {'vocabulary':<24} {vocab}")
    for key, label in HYPERPARAMETERS:
        value = m.get(f"{arch}.{key}")
        if value is not None:
            out.append(f"  {label:<24} {value}")

    per_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    globals_: list[TensorInfo] = []
    for t in g.tensors:
        match = BLOCK_TENSOR.match(t.name)
        (per_layer[int(match.group(1))] if match else globals_).append(t)
    out.append("per layer:")
    for i in sorted(set(per_layer) | set(range(len(kinds)))):
        ts = per_layer.get(i, [])
        kind = KIND_NAMES.get(kinds[i], "") if i < len(kinds) else "(beyond block_count)"
        types = ", ".join(sorted({t.type for t in ts}))
        out.append(
            f"  blk.{i:<4} {kind:<22} {len(ts):>4} tensors {human_bytes(sum(t.nbytes for t in ts)):>12}  {types}".rstrip()
        )
    if globals_:
        out.append(
            f"  {'other':<9}{'':<22} {len(globals_):>4} tensors "
            f"{human_bytes(sum(t.nbytes for t in globals_)):>12}  {', '.join(sorted({t.type for t in globals_}))}"
        )

    out.append("tensor types:")
    supported = set(_qk.supported_types())
    by_type: dict[str, list[TensorInfo]] = defaultdict(list)
    for t in g.tensors:
        by_type[t.type].append(t)
    for ty, ts in sorted(by_type.items(), key=lambda kv: -sum(t.nbytes for t in kv[1])):
        params = sum(t.n_elements for t in ts)
        nbytes = sum(t.nbytes for t in ts)
        mark = "" if ty in supported else "  UNSUPPORTED by qk"
        out.append(f"  {ty:<8} {len(ts):>5} tensors {params:>15,} weights {human_bytes(nbytes):>12}{mark}")

    params = sum(t.n_elements for t in g.tensors)
    nbytes = sum(t.nbytes for t in g.tensors)
    bpw = f", {8 * nbytes / params:.2f} bits/weight" if params else ""
    out.append(f"total: {len(g)} tensors, {params:,} weights, {nbytes:,} bytes ({human_bytes(nbytes)}){bpw}")
    out.append(support_line(g.tensors, kinds, supported))
    return "\n".join(out)


def support_line(tensors: Sequence[TensorInfo], kinds: list[str], supported: set[str]) -> str:
    """Whether qk loads the file: it refuses a tensor of a type it cannot read, except in MTP blocks,
    which the main pass never loads."""
    bad = [t for t in tensors if t.type not in supported]
    if not bad:
        return "qk support: every tensor type loads"

    def in_mtp(t: TensorInfo) -> bool:
        match = BLOCK_TENSOR.match(t.name)
        return bool(match) and int(match.group(1)) < len(kinds) and kinds[int(match.group(1))] == "mtp"

    types = ", ".join(
        f"{ty} ({sum(t.type == ty for t in bad)} tensors, first {next(t.name for t in bad if t.type == ty)})"
        for ty in sorted({t.type for t in bad})
    )
    if all(in_mtp(t) for t in bad):
        return f"qk support: the model loads; MTP blocks hold types qk cannot read: {types}"
    return f"qk support: UNSUPPORTED tensor types, qk cannot load this model: {types}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qk.info", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file, or the first shard NAME-00001-of-0000N.gguf")
    parser.add_argument(
        "--header-only", action="store_true", help="read only metadata and tensor tables (data may be absent)"
    )
    args = parser.parse_args(argv)
    from qk import GgufError

    try:
        text = summarize(Gguf(args.model, header_only=args.header_only))
    except (GgufError, OSError, ValueError) as e:
        print(f"qk.info: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
