"""``python -m qk.worker``: one pipeline stage of a split model — the engine for layers ``[A, B)`` behind
the qkp transport (docs/protocol.md), no HTTP. It answers one head session at a time, forwards hidden
rows to ``--next`` unless it runs the model's last layers, and keeps serving when a peer misbehaves.
This module only parses flags, loads the engine and reports: the serve loop, and every request from
socket to GPU and back, runs in Rust (``qk._qk.Worker`` around a ``qk._qk.EngineStage``).

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


def _prefill_rows(text: str) -> int:
    n = int(text)
    if n < 64 or n % 64:
        raise argparse.ArgumentTypeError(f"{n} is not a positive multiple of 64")
    return n


def _microseconds(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--cache-type-k`` / ``--cache-type-v`` / ``--prefill-rows`` / ``--spin-wait-us`` /
    ``--no-weight-arena`` / ``--armed-steps``, shared with ``qk.serve``."""
    p.add_argument(
        "--cache-type-k", choices=("f16", "q8_0", "f32"), help="K cache element type (default f16)"
    )
    p.add_argument("--cache-type-v", choices=("f16", "f32"), help="V cache element type (default f16)")
    p.add_argument(
        "--prefill-rows",
        type=_prefill_rows,
        help="positions per prefill piece, a multiple of 64 (default: 2048 on a discrete GPU where its "
        "scratch fits, else 512); outputs are the same whatever it is, the scratch grows with it",
    )
    p.add_argument(
        "--spin-wait-us",
        type=_microseconds,
        help="microseconds a decode step's wait for the GPU polls without sleeping before it blocks "
        "(default 20000 on a GPU, 0 on a CPU adapter); 0 frees the core at some cost per token",
    )
    p.add_argument(
        "--no-weight-arena",
        action="store_true",
        help="every weight tensor in a GPU buffer of its own (default: the small ones share a few, "
        "fewer buffers for each decode step's submit to track); the outputs are the same",
    )
    p.add_argument(
        "--armed-steps",
        action="store_true",
        help="on Vulkan, each host-fed decode step (a split stage's; a sampled request's) submits its "
        "likely successor ahead, held on the GPU until its input arrives (the submit leaves the "
        "per-token path; a device of its own and one spare slot of recurrent state); the outputs are "
        "the same. A split whose stages share one GPU is slower with it (a second context takes turns)",
    )


def engine_args(args: argparse.Namespace) -> dict[str, str | int | bool]:
    """The engine keywords of the flags of ``add_engine_args`` that were given (absent ones keep
    the engine's defaults)."""
    given = {
        "cache_type_k": args.cache_type_k,
        "cache_type_v": args.cache_type_v,
        "prefill_rows": args.prefill_rows,
        "spin_wait_us": args.spin_wait_us,
        "weight_arena": False if args.no_weight_arena else None,
        "armed_steps": True if args.armed_steps else None,
    }
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
    add_engine_args(p)
    p.add_argument(
        "--pre-auth-timeout",
        type=float,
        default=5.0,
        help="seconds a new connection has to send its hello and prove the secret (default: 5)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=16,
        help="connections allowed in their hello at once; more are refused at accept (default: 16)",
    )
    return p


def load_stage(args: argparse.Namespace) -> tuple[Any, int]:
    """The engine for ``--layers`` as the native stage the worker serves, and how long the engine's
    waits poll before they sleep (the worker's socket waits do the same)."""
    try:
        from qk import _qk
    except ImportError as e:
        sys.exit(f"qk.worker: the native module qk._qk is not installed ({e})")
    from qk.gguf import Gguf

    a, b = args.layers
    fingerprint = Gguf(args.model, header_only=True).fingerprint
    engine = _qk.Engine(
        args.model,
        layers=(a, b),
        slots=args.slots,
        ctx=args.ctx,
        device=args.device,
        precise=args.precise,
        **engine_args(args),
    )
    return _qk.EngineStage(engine, fingerprint, args.snapshots), int(engine.info()["spin_wait_us"])


def __getattr__(name: str) -> Any:
    # ``qk.worker.EngineStage`` is the native stage, imported on first use like the rest of qk._qk.
    if name == "EngineStage":
        from qk._qk import EngineStage

        return EngineStage
    raise AttributeError(f"module 'qk.worker' has no attribute {name!r}")


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
    if args.pre_auth_timeout <= 0 or args.max_pending < 1:
        parser.error("--pre-auth-timeout must be > 0 and --max-pending ≥ 1")
    stage, spin = load_stage(args)

    from qk import _qk

    worker = _qk.Worker(
        stage,
        host=args.host,
        port=args.port,
        name=args.name or f"{args.host}:{args.port}",
        secret=secret,
        next=args.next,
        takeover_next=args.takeover,
        pre_auth_timeout=args.pre_auth_timeout,
        max_pending=args.max_pending,
        spin_wait_us=spin,
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
