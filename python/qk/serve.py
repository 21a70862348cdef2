"""``python -m qk.serve``: serve one GGUF model over HTTP on this box (all layers, N slots).

Without ``--model`` it serves the built-in demo: a tiny random-weight model of the real
architecture, written on first start into ``$QK_CACHE/demo`` (default ``~/.cache/qk/demo``) with
qk's own small vocabulary and a ChatML template. Its replies are noise; it exists so the API can be
tried (and clients wired up) without a real model.

With ``--layers 0:A --split-next HOST:PORT`` it is the head of a split model: it runs layers
``[0, A)`` and the worker chain behind HOST:PORT (``python -m qk.worker``) runs the rest (qk.split).

Example::

    python -m qk.serve --model Qwen3-Next-80B-A3B-Instruct-IQ4_XS.gguf --slots 4 --api-key s3cret
    python -m qk.serve --model M.gguf --layers 0:24 --split-next 10.0.0.2:18100 --secret s3cret
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qk.server.validate import Limits

__all__ = ["demo_model_path", "main"]

log = logging.getLogger("qk.serve")

#: Per-slot context by default: agent system prompts alone run to 15–25k tokens.
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


def _layers(text: str) -> tuple[int, int]:
    from qk.worker import parse_layers

    return parse_layers(text)


def _loader(
    path: Path,
    slots: int,
    ctx: int,
    device: str | None,
    name: str,
    options: dict[str, str | int],
    precise: bool,
):
    def load():
        # qk.engine (the native engine's Python home) rather than the lazy `qk.Engine` attribute,
        # which the package root exports only once the engine is wired into it.
        from qk.driver import LocalDriver
        from qk.engine import Engine
        from qk.server import Loaded
        from qk.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(path)
        engine = Engine(
            str(path), layers=None, slots=slots, ctx=ctx, device=device, precise=precise, **options
        )
        return Loaded(LocalDriver(engine), tokenizer, name, str(path))

    return load


def _split_loader(
    path: Path, layers: tuple[int, int], next_addr: str, args: argparse.Namespace, name: str
) -> Callable[[], Any]:
    def load():
        import random

        from qk import _qk
        from qk.gguf import Gguf
        from qk.server import Loaded
        from qk.split import SplitDriver, head_stage
        from qk.tokenizer import Tokenizer
        from qk.worker import engine_args

        tokenizer = Tokenizer.from_gguf(path)
        engine = _qk.Engine(
            str(path),
            layers=layers,
            slots=args.slots,
            ctx=args.ctx,
            device=args.device,
            precise=args.precise,
            **engine_args(args),
        )
        fingerprint = Gguf(str(path), header_only=True).fingerprint
        own = head_stage(
            engine, fingerprint, args.snapshots, f"head {args.host}:{args.port}", random.getrandbits(63) + 1
        )
        secret = args.secret if args.secret is not None else os.environ.get("QK_SECRET") or None
        # The link waits for the chain's reply as the engine waits for the GPU (polling on a GPU).
        spin = int(engine.info()["spin_wait_us"])
        link = _qk.HeadLink(next_addr, own, secret=secret, takeover=args.takeover, spin_wait_us=spin)
        driver = SplitDriver(engine, link, target=next_addr, lanes=args.lanes)
        driver.connect()
        return Loaded(driver, tokenizer, name, str(path))

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
        "--precise",
        action="store_true",
        help="f32 products throughout (default: prefill mat-mats on tensor cores, f16 inputs, where available)",
    )
    p.add_argument(
        "--api-key", default=os.environ.get("QK_API_KEY"), help="required on every route but /health"
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 529/429")
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=Limits.max_body_bytes / 2**20,
        help="largest request body, MiB; larger ones are answered 413 (default: %(default)g)",
    )
    p.add_argument(
        "--max-json-values",
        type=int,
        default=Limits.max_json_values,
        help="JSON values in a request body; more are answered 413 (default: %(default)d)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=Limits.max_connections,
        help="HTTP connections served at once; more are answered 503 (default: %(default)d)",
    )
    p.add_argument(
        "--prepare-threads",
        type=int,
        default=Limits.prepare_threads,
        help="requests parsed, rendered and tokenised at once, off the event loop (default: %(default)d)",
    )
    p.add_argument(
        "--snapshots", type=int, default=16, help="saved conversation states kept for cross-turn reuse"
    )
    p.add_argument(
        "--snapshot-gib", type=float, default=4.0, help="GPU memory the saved states may hold (GiB)"
    )
    p.add_argument("--no-reuse", action="store_true", help="prefill every prompt in full")
    p.add_argument("--layers", type=_layers, help="A:B — run only these layers here (a split head runs 0:A)")
    p.add_argument(
        "--split-next", metavar="HOST:PORT", help="the worker running the layers after --layers (split head)"
    )
    p.add_argument("--secret", default=None, help="shared secret with the workers (default: $QK_SECRET)")
    p.add_argument(
        "--lanes",
        type=int,
        default=1,
        choices=(1, 2),
        help="split head: groups of slots in flight (1: all slots batched; 2 when each stage has its own GPU)",
    )
    p.add_argument(
        "--takeover",
        action="store_true",
        help="split head: take the chain over from another head holding it (off by default: a second "
        "head is refused 'busy'; the head that loses the chain reports it on /health)",
    )
    p.add_argument("--alias", help="model name reported by the API (default: the file name)")
    p.add_argument("--log-level", default="info")
    from qk.worker import add_engine_args

    add_engine_args(p)
    args = p.parse_args(argv)
    if args.slots < 1 or args.ctx < 2 or args.max_queue < 0:
        p.error("--slots must be ≥ 1, --ctx ≥ 2, --max-queue ≥ 0")
    try:
        args.limits = Limits(
            max_body_bytes=int(args.max_body_mib * 2**20),
            max_json_values=args.max_json_values,
            max_connections=args.max_connections,
            prepare_threads=args.prepare_threads,
        )
    except ValueError as e:
        p.error(f"--max-body-mib, --max-json-values, --max-connections, --prepare-threads: {e}")
    if args.split_next is not None and args.layers is None:
        p.error("--split-next needs --layers 0:A (the layers this head runs)")
    if args.layers is not None and args.layers[0] != 0:
        p.error(f"--layers {args.layers[0]}:{args.layers[1]}: the head runs the first layers (0:A)")
    if args.split_next is not None and args.model is None:
        p.error("--split-next needs --model (the workers load the same file)")
    if not args.no_reuse and (args.snapshots < 1 or args.snapshot_gib <= 0):
        p.error("--snapshots must be ≥ 1 and --snapshot-gib > 0 (or pass --no-reuse)")
    return args


def main(argv: list[str] | None = None, *, load: Callable[[], Any] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. ``load`` replaces the engine loader (tests)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from qk.scheduler import ReuseSettings
    from qk.server import create_app
    from qk.worker import engine_args

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
    if load is None and args.split_next is not None:
        load = _split_loader(path, args.layers, args.split_next, args, name)
    elif load is None and args.layers is not None:
        from qk.gguf import Gguf

        g = Gguf(str(path), header_only=True)
        meta = g.metadata
        # MTP blocks after the main stack are not layers a stage runs.
        n_layer = int(meta[f"{g.arch}.block_count"]) - int(meta.get(f"{g.arch}.nextn_predict_layers", 0))
        if args.layers != (0, n_layer):
            print(
                f"qk.serve: --layers {args.layers[0]}:{args.layers[1]} leaves layers to run elsewhere: "
                "give --split-next HOST:PORT (the worker with the next layers)",
                file=sys.stderr,
            )
            return 2
    app = create_app(
        load or _loader(path, args.slots, args.ctx, args.device, name, engine_args(args), args.precise),
        slots=args.slots,
        ctx=args.ctx,
        api_key=args.api_key,
        max_queue=args.max_queue,
        reuse=None
        if args.no_reuse
        else ReuseSettings(max_entries=args.snapshots, max_bytes=int(args.snapshot_gib * 2**30)),
        limits=args.limits,
    )
    # uvicorn's own SIGTERM handling is the drain: it stops accepting, lets open responses finish,
    # then runs the lifespan shutdown (which waits for the engine thread).
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=None,
        limit_concurrency=args.limits.max_connections,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
