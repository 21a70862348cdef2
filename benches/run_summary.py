#!/usr/bin/env python3
"""One line from an engine_bench.py JSON, for the device scripts that compare runs in one lease
(benches/h200_ab.sh, benches/h200_sweep.sh): one stream's chained and host-fed ms/token, the
all-slots chained rate and the GPU µs per step of each op family of the 1-slot and the all-slots
profile.

usage: python benches/run_summary.py NAME RESULT.json
"""

from __future__ import annotations

import json
import sys


def result(name: str, path: str) -> dict | None:
    """The run's JSON; None (and a line saying so) when the run left none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        print(f"{name}: no result (see its .err)")
        return None


def main() -> None:
    name, path = sys.argv[1:3]
    d = result(name, path)
    if d is None:
        return
    slots = d.get("slots")
    families = {}
    for p in d.get("profile", []):
        if p["rows"] in (1, slots):
            for f in p["families"]:
                families[f"{f['op']}@{p['rows']}"] = round(f["gpu_us"]) if f["gpu_us"] is not None else None
    host_wait = d.get("decode_host", {}).get("wait_us", {}).get("median")
    print(
        f"{name}: chained {d.get('decode_chained_ms_per_token')} ms, host-fed {d.get('decode_ms_per_token')} ms, "
        f"wait median {host_wait} us, {slots} slots chained {d.get('multi_slot_chained_tok_s')} tok/s; "
        f"profile us {families}"
    )


if __name__ == "__main__":
    main()
