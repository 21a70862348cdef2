"""Time to first token of turn 2 of a long conversation, with and without cross-turn state reuse
(qk.reuse): turn 1 runs first (and, with reuse, saves its history state); turn 2 then either
restores it and prefills only the new turn, or prefills everything. Prints a small table.

Runs the scheduler and engine directly (no HTTP), so the numbers are the engine's.

    python benches/reuse_ttft.py                                  # tiny fixture, ~2k history (lavapipe)
    python benches/reuse_ttft.py --model M.gguf --history 8192   # a real model on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from qk.chat import ChatTemplate
from qk.driver import LocalDriver
from qk.scheduler import Finished, GenerationRequest, ReuseSettings, Scheduler, Token
from qk.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-qwen35moe-f32.gguf"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def conversation(template: ChatTemplate, tokenizer: Tokenizer, history_tokens: int) -> list[dict]:
    """System prompt plus filler turns until the rendered conversation reaches ``history_tokens``."""
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    turn = 0
    while True:
        words = " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(40))
        messages.append({"role": "user", "content": f"Note {turn}: {words}"})
        messages.append({"role": "assistant", "content": f"Noted {turn}."})
        turn += 1
        text = template.render(messages, add_generation_prompt=False).text
        if len(tokenizer.encode(text, special=True)) >= history_tokens:
            return messages


def encode(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Prompt ids and the history boundary (what the next turn's prompt will start with)."""
    prompt = tokenizer.encode(template.render(messages).text, special=True)
    history = tokenizer.encode(template.render(messages, add_generation_prompt=False).text, special=True)
    common = next((i for i, (a, b) in enumerate(zip(prompt, history, strict=False)) if a != b), len(history))
    return prompt, common


async def first_token(scheduler: Scheduler, prompt: list[int], history: int) -> tuple[float, int]:
    started = time.perf_counter()
    job = scheduler.submit(GenerationRequest(prompt, 1, history=history))
    elapsed = None
    while True:
        event = await job.next_event()
        if isinstance(event, Token) and elapsed is None:
            elapsed = time.perf_counter() - started
        if isinstance(event, Finished):
            return (elapsed if elapsed is not None else time.perf_counter() - started), job.cached
        if not isinstance(event, Token):
            raise RuntimeError(f"generation failed: {event}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(FIXTURE))
    p.add_argument("--history", type=int, default=2048, help="tokens of conversation before turn 2")
    p.add_argument("--ctx", type=int, default=0, help="context per slot (default: history + 1024)")
    p.add_argument("--device")
    args = p.parse_args()

    from qk.engine import Engine

    tokenizer = Tokenizer.from_gguf(args.model)
    template = ChatTemplate.from_tokenizer(tokenizer)
    ctx = args.ctx or args.history + 1024
    engine = Engine(args.model, slots=1, ctx=ctx, device=args.device)
    messages = conversation(template, tokenizer, args.history)
    turn1 = messages + [{"role": "user", "content": "Summarise the notes."}]
    turn2 = turn1 + [
        {"role": "assistant", "content": "They list words."},
        {"role": "user", "content": "Which word comes first?"},
    ]
    p1, h1 = encode(template, tokenizer, turn1)
    p2, h2 = encode(template, tokenizer, turn2)
    if len(p2) >= ctx:
        raise SystemExit(f"turn 2 has {len(p2)} tokens; raise --ctx")

    rows = []
    for label, reuse in (("no reuse", None), ("reuse", ReuseSettings(max_entries=4, max_bytes=64 << 30))):
        scheduler = Scheduler(lambda: LocalDriver(engine), slots=1, ctx=ctx, reuse=reuse)
        scheduler.start()

        async def run(scheduler: Scheduler = scheduler) -> tuple[float, int, float, int]:
            # Warm-up (pipelines compiled, first-use costs) on a short unrelated prompt.
            await first_token(scheduler, p2[:64], 0)
            t1, _ = await first_token(scheduler, p1, h1)
            t2, cached = await first_token(scheduler, p2, h2)
            return t1, 0, t2, cached

        t1, _, t2, cached = asyncio.run(run())
        scheduler.drain(30)
        rows.append((label, len(p1), t1, len(p2), cached, len(p2) - cached, t2))

    print(f"model {Path(args.model).name}, {engine.info()['adapter']}")
    header = ("mode", "turn1 tok", "turn1 TTFT s", "turn2 tok", "reused", "prefilled", "turn2 TTFT s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, n1, t1, n2, cached, fresh, t2 in rows:
        print(f"| {label} | {n1} | {t1:.3f} | {n2} | {cached} | {fresh} | {t2:.3f} |")
    base, reused = rows[0][-1], rows[1][-1]
    print(f"turn-2 TTFT speed-up with reuse: {base / reused:.1f}x")


if __name__ == "__main__":
    main()
