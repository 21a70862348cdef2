#!/usr/bin/env python3
"""One line from a split_bench.py JSON, for benches/h200_split.sh: one stream's ms/token unsplit and
split and their ratio, where a split step's time goes (the head's layers, the chain's round trip,
each in-process engine's host record, submit and wait, and with the worker in process the link's
share: the round trip less the worker's engine), the idle ping, the 2-slot aggregates, and whether
every run's tokens matched.

usage: python benches/split_summary.py NAME RESULT.json
"""

from __future__ import annotations

import sys

from run_summary import result  # benches/ is the script's own directory, first on sys.path


def engine_part(name: str, t: dict) -> str:
    ahead_record = f" ({t['ahead_record_us']} for those recorded ahead)" if "ahead_record_us" in t else ""
    return (
        f"{name} engine {t['total_us']} us (record {t['record_us']}{ahead_record}, submit {t['submit_us']}, "
        f"wait {t['wait_us']}, ahead {t['ahead']})"
    )


def main() -> None:
    name, path = sys.argv[1:3]
    d = result(name, path)
    if d is None:
        return
    u, s = d["unsplit"], d.get("split_lanes1", {})
    parts = [
        f"unsplit {u['single_ms_per_token']} ms, split {s.get('single_ms_per_token')} ms "
        f"({d.get('split_over_unsplit_ms')}x, +{d.get('split_extra_ms_per_token')} ms)",
    ]
    step = s.get("single_step")
    if step:
        parts.append(f"head {step['head_ms']} ms, chain {step['chain_ms']} ms")
    for stage in ("head", "worker"):
        if f"single_{stage}_engine" in s:
            parts.append(engine_part(stage, s[f"single_{stage}_engine"]))
    worker = s.get("single_worker_engine")
    if step and worker:
        # The chain's round trip less the worker's engine: the frames both ways and the stage loop.
        parts.append(f"link {step['chain_ms'] * 1000 - worker['total_us']:.1f} us")
    parts.append(f"ping {s.get('ping_ms')} ms")
    parts.append(f"2 slots {u['two_slot_aggregate_tok_s']} / {s.get('two_slot_aggregate_tok_s')} tok/s")
    parts.append(f"tokens identical {d.get('tokens_identical')}")
    print(f"{name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
