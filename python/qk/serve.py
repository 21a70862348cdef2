"""``python -m qk.serve``: serve one GGUF model over HTTP on this box (all layers, N slots).

Without ``--model`` it serves the built-in demo: a tiny random-weight model of the real
architecture, written on first start into ``$QK_CACHE/demo`` (default ``~/.cache/qk/demo``) with
qk's own small vocabulary and a ChatML template. Its replies are noise; it exists so the API can be
tried (and clients wired up) without a real model.

Example::

    python -m qk.serve --model Qwen3-Next-80B-A3B-Instruct-IQ4_XS.gguf --slots 4 --api-key s3cret
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["demo_model_path", "main"]

log = logging.getLogger("qk.serve")

#: Per-slot context by default: agent system prompts alone run to 15–25k tokens (DESIGN.md).
DEFAULT_CTX = 32768
DEMO_ARCH = "qwen35moe"
DEMO_SEED = 0
DEMO_VERSION = 1


def demo_model_path() -> Path:
    """Where the demo model lives, written there on first use."""
    base = os.environ.get("QK_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "qk"
    path = root / "demo" / f"qk-demo-{DEMO_ARCH}-v{DEMO_VERSION}.gguf"
    if not path.exists():
        from qk import testmodel

        log.info("writing the demo model to %s", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the target and renamed, so a crash never leaves half a model behind.
        partial = path.with_suffix(f".partial-{os.getpid()}")
        testmodel.write_model(partial, DEMO_ARCH, seed=DEMO_SEED, name="qk-demo (random weights)")
        partial.replace(path)
    return path


def _loader(path: Path, slots: int, ctx: int, device: str | None, name: str):
    def load():
        # qk.engine (the native engine's Python home) rather than the lazy `qk.Engine` attribute,
        # which the package root exports only once the engine is wired into it.
        from qk.driver import LocalDriver
        from qk.engine import Engine
        from qk.server import Loaded
        from qk.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(path)
        engine = Engine(str(path), layers=None, slots=slots, ctx=ctx, device=device)
        return Loaded(LocalDriver(engine), tokenizer, name, str(path))

    return load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m qk.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file (first shard of a split file); none: the built-in demo")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--slots", type=int, default=1, help="concurrent sequences decoded together")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="context length per slot")
    p.add_argument("--device", help="GPU index or name")
    p.add_argument(
        "--api-key", default=os.environ.get("QK_API_KEY"), help="required on every route but /health"
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 529/429")
    p.add_argument("--alias", help="model name reported by the API (default: the file name)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.slots < 1 or args.ctx < 2 or args.max_queue < 0:
        p.error("--slots must be ≥ 1, --ctx ≥ 2, --max-queue ≥ 0")
    return args


def main(argv: list[str] | None = None, *, load: Callable[[], Any] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. ``load`` replaces the engine loader (tests)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from qk.server import create_app

    if load is not None:
        name = args.alias or "custom"
    elif args.model:
        path = Path(args.model)
        if not path.exists():
            print(f"qk.serve: no such model file: {path}", file=sys.stderr)
            return 2
        name = args.alias or path.stem
    else:
        path = demo_model_path()
        name = args.alias or "qk-demo"
        banner = (
            f"qk.serve: no --model given: serving the built-in DEMO model ({path}).\n"
            "qk.serve: its weights are RANDOM — every reply is noise. Pass --model M.gguf for a real model."
        )
        print(banner, file=sys.stderr)
        log.warning("serving the demo model: random weights, replies are noise")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach the port can use it", args.host)
    app = create_app(
        load or _loader(path, args.slots, args.ctx, args.device, name),
        slots=args.slots,
        ctx=args.ctx,
        api_key=args.api_key,
        max_queue=args.max_queue,
    )
    # uvicorn's own SIGTERM handling is the drain: it stops accepting, lets open responses finish,
    # then runs the lifespan shutdown (which waits for the engine thread).
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=None
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
