"""Smoke runs of the benchmark scripts on a tiny fixture: a benchmark that only ever runs on the H200
would otherwise break unseen between device sessions. The numbers are not checked (lavapipe's say
nothing about a GPU's); that each script runs to the end and prints the JSON its callers read is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qk._qk import adapters

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-qwen3next-f32.gguf"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_adapter():
    if not adapters() and os.environ.get("QK_REQUIRE_GPU") != "1":
        pytest.skip("no GPU adapter")


def run_bench(*args: str, timeout: float = 400) -> dict:
    """Run a benches/ script; its stdout must be one JSON document (tables go to stderr)."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.timeout(600)
def test_split_bench_runs_both_lane_settings_to_the_end():
    # Armed steps on both stages (the worker a process of its own), as the device sweep runs them.
    out = run_bench(
        "benches/split_bench.py",
        str(FIXTURE),
        "--prompt",
        "16",
        "--decode",
        "3",
        "--ctx",
        "128",
        "--armed-steps",
    )
    assert out["tokens_identical"] is True and out["armed_steps"] is True
    for part in ("unsplit", "split_lanes1", "split_lanes2"):
        assert out[part]["single_ms_per_token"] > 0


@pytest.mark.timeout(600)
def test_split_bench_with_the_worker_in_process_times_each_stage(tmp_path):
    out = run_bench(
        "benches/split_bench.py",
        str(FIXTURE),
        *("--prompt", "16", "--decode", "3", "--ctx", "128", "--lanes", "1", "--worker-in-process"),
        # Both ends of the link poll their sockets a while before they sleep.
        *("--socket-spin-us", "2000"),
        # Every engine's weights each in a buffer of its own (the other split tests run the arena).
        "--no-weight-arena",
    )
    assert out["tokens_identical"] is True and out["worker_in_process"] is True
    assert out["socket_spin_us"] == 2000 and out["weight_arena"] is False
    split = out["split_lanes1"]
    assert split["ping_ms"] > 0
    for stage in ("head", "worker"):
        timing = split[f"single_{stage}_engine"]
        # Every stage stepped once per token after the first (the prefill's answer).
        assert timing["steps"] == 2 and timing["total_us"] >= timing["wait_us"] > 0
    assert out["unsplit"]["single_unsplit_engine"]["steps"] > 0
    # The device script's one-line summary reads the same JSON.
    path = tmp_path / "split.json"
    path.write_text(json.dumps(out))
    line = subprocess.run(
        [sys.executable, "benches/split_summary.py", "in-process", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert line.startswith("in-process: unsplit ") and "worker engine" in line and "; link " in line
    assert line.rstrip().endswith("tokens identical True")


@pytest.mark.timeout(600)
def test_engine_bench_with_profile_prints_its_json():
    out = run_bench(
        "benches/engine_bench.py",
        str(FIXTURE),
        "--prompt",
        "16",
        "--decode",
        "3",
        "--slots",
        "2",
        "--ctx",
        "128",
        "--profile",
        # Armed host-fed steps, beside the chained ones, the profile and the scheduler's.
        "--armed-steps",
    )
    assert out["armed_steps"] is True
    assert out["decode_ms_per_token"] > 0 and out["decode_chained_ms_per_token"] > 0
    host = out["decode_host"]
    assert 0 < host["wait_us"]["median"] <= host["wait_us"]["max"]
    # The Python call wraps the engine's step, so each call takes at least its step's total.
    assert host["call_us"]["median"] >= host["total_us"]["median"]
    assert out["chained_tokens_identical"] is True
    assert set(out["scheduler_aggregate_tok_s"]) == {"1", "2"}
    assert "profile" in out


def test_engine_bench_warms_every_piece_shape():
    """The warm-up runs each piece length rust/engine.rs piece_len cuts a prompt into (512-row pieces,
    then the rest, whose last partial chunk of up to 15 rows may run on its own), so the timed
    prefill compiles nothing."""
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        from engine_bench import piece_shapes
    finally:
        sys.path.pop(0)
    assert piece_shapes(4096) == [512]
    assert piece_shapes(600) == [88, 512]
    assert piece_shapes(520) == [8, 512]
    assert piece_shapes(100) == [100]
    assert piece_shapes(70) == [6, 64, 70]
    assert piece_shapes(32768 + 70) == [6, 64, 70, 512]
