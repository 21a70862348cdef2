"""``python -m qk.worker``: one pipeline stage of a split model — the engine for layers ``[A, B)`` behind
the qkp transport (docs/protocol.md), no HTTP. It answers one head session at a time, forwards hidden
rows to ``--next`` unless it runs the model's last layers, and keeps serving when a peer misbehaves.

Listens on loopback by default; any other address needs a shared secret (``--secret`` or
``QK_SECRET``) or an explicit ``--insecure``, so an open port is not an open door.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_PORT = 18100


def parse_layers(text: str) -> tuple[int, int]:
    first, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a, b = int(first), int(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants A:B (two integers), got {text!r}") from None
    if a < 0 or b <= a:
        raise argparse.ArgumentTypeError(f"--layers {text}: the range [{a}, {b}) is empty or negative")
    return a, b


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def stage_info(engine: Any, fingerprint: str, snap_entries: int) -> dict:
    """What a hello says of a stage running ``engine`` (docs/protocol.md "Stage description"): its layers, the model's
    shape, slots and context, snapshot capacity, model fingerprint and adapter."""
    info = engine.info()
    first, end = info["layers"]
    memory = info["memory"]
    return {
        "layer_first": int(first),
        "layer_end": int(end),
        "n_layer": int(info["n_layer"]),
        "n_embd": int(info["n_embd"]),
        "slots": int(info["slots"]),
        "ctx": int(info["ctx"]),
        "snap_entries": snap_entries,
        "snap_bytes": snap_entries * int(memory["kv_per_slot"] + memory["deltanet_per_slot"]),
        "fingerprint": fingerprint,
        "adapter": str(info["adapter"]),
    }


class EngineStage:
    """A ``qk.Engine`` as the stage ``qk._qk.Worker`` serves (the methods in STAGE_METHODS), through the
    engine's public API; the engine releases the GIL while the GPU works. The engine has no snapshot
    cap, so the worker advertises ``snap_entries`` and refuses indices past it; ``snap_bytes`` is what
    that many whole slot states (KV + DeltaNet) may hold."""

    def __init__(self, engine: Any, fingerprint: str, snap_entries: int) -> None:
        self.engine = engine
        self.info = stage_info(engine, fingerprint, snap_entries)
        self.last = self.info["layer_end"] == self.info["n_layer"]
        self.saved: set[int] = set()

    def describe(self) -> dict:
        return dict(self.info)

    def run(self, slot: int, base: int, tokens: Any, hidden: Any, topk: int) -> Any:
        return self.engine.stage_run(slot, tokens if tokens is not None else hidden, base, topk)

    def step(self, entries: list[tuple[int, int]], tokens: Any, hidden: Any, topk: int) -> Any:
        for slot, base in entries:
            position = self.engine.position(slot)
            if base != position:
                raise ValueError(f"step: base {base} for slot {slot}, which is at position {position}")
        outs = self.engine.step([slot for slot, _ in entries], tokens if tokens is not None else hidden, topk)
        if not self.last:
            return np.concatenate(outs)
        return [ids[0] for ids, _ in outs], [pairs for _, pairs in outs]

    def save(self, slot: int, idx: int) -> None:
        if idx >= self.info["snap_entries"]:
            raise ValueError(f"snapshot {idx} past this worker's {self.info['snap_entries']} entries")
        self.engine.state_save(slot, idx)
        self.saved.add(idx)

    def load(self, slot: int, idx: int) -> None:
        self.engine.state_load(slot, idx)

    def drop(self, idx: int) -> None:
        if idx in self.saved:
            self.engine.state_drop(idx)
            self.saved.discard(idx)

    def reset(self) -> None:
        # Slots reset themselves on their next base-0 run; snapshots must go now.
        for idx in sorted(self.saved):
            self.engine.state_drop(idx)
        self.saved.clear()


def add_cache_type_args(p: argparse.ArgumentParser) -> None:
    """``--cache-type-k`` / ``--cache-type-v``, shared with ``qk.serve``."""
    p.add_argument(
        "--cache-type-k", choices=("f16", "q8_0", "f32"), help="K cache element type (default f16)"
    )
    p.add_argument("--cache-type-v", choices=("f16", "f32"), help="V cache element type (default f16)")


def cache_types(args: argparse.Namespace) -> dict[str, str]:
    """The engine keywords of the cache-type flags that were given (absent ones keep the engine's
    default)."""
    given = {"cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v}
    return {k: v for k, v in given.items() if v is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qk.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF file (first shard of a split file)")
    p.add_argument("--layers", required=True, type=parse_layers, help="A:B, the layers this stage runs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--slots", type=int, default=4, help="sequences served at once (cover the head's)")
    p.add_argument("--ctx", type=int, default=32768, help="positions per slot (cover the head's)")
    p.add_argument("--device", default=None, help="GPU adapter index or name")
    p.add_argument(
        "--precise",
        action="store_true",
        help="f32 products throughout (default: prefill mat-mats on tensor cores, f16 inputs, where available)",
    )
    p.add_argument("--snapshots", type=int, default=16, help="state snapshot entries offered to the head")
    p.add_argument("--next", default=None, help="host:port of the next stage (none for the last stage)")
    p.add_argument("--secret", default=None, help="shared secret for both hops (default: $QK_SECRET)")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without a shared secret"
    )
    p.add_argument(
        "--takeover",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replace a session the next stage still holds from this stage's previous run (default: on)",
    )
    p.add_argument("--name", default=None, help="this stage's name in errors and logs (default host:port)")
    add_cache_type_args(p)
    return p


def load_engine(args: argparse.Namespace) -> Any:
    try:
        from qk import _qk
    except ImportError as e:
        sys.exit(f"qk.worker: the native module qk._qk is not installed ({e})")
    engine_class = getattr(_qk, "Engine", None)
    if engine_class is None:
        sys.exit(
            "qk.worker: this build of qk has no qk.Engine yet (the native engine is not part of it), "
            "so there is nothing to serve"
        )
    from qk.gguf import Gguf

    a, b = args.layers
    fingerprint = Gguf(args.model, header_only=True).fingerprint
    engine = engine_class(
        args.model,
        layers=(a, b),
        slots=args.slots,
        ctx=args.ctx,
        device=args.device,
        precise=args.precise,
        **cache_types(args),
    )
    return EngineStage(engine, fingerprint, args.snapshots)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    secret = args.secret if args.secret is not None else os.environ.get("QK_SECRET") or None
    if not is_loopback(args.host) and secret is None and not args.insecure:
        parser.error(
            f"refusing to listen on {args.host} without a shared secret: give --secret (or set QK_SECRET) "
            "so only your head can drive this stage, or --insecure to accept anyone who can reach the port"
        )
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is not a TCP port")
    stage = load_engine(args)

    from qk import _qk

    worker = _qk.Worker(
        stage,
        host=args.host,
        port=args.port,
        name=args.name or f"{args.host}:{args.port}",
        secret=secret,
        next=args.next,
        takeover_next=args.takeover,
    )
    # serve() blocks in Rust with the GIL released; the main thread stays in Python to take signals.
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            worker.serve()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=serve, name="qk.worker", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        worker.stop()
        thread.join()
    if errors:
        print(f"qk.worker: {errors[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
