"""The qkp frame codec through Python (qk._qk.qkp_encode / qkp_decode): random valid messages round
trip exactly, and mutated, truncated or random bytes never crash the decoder — they decode to a
canonical message or raise qk.TransportError."""

from __future__ import annotations

import math
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from qk import TransportError
from qk._qk import (
    QKP_HEADER_LEN,
    QKP_MAX_NAME,
    QKP_MAX_ROWS,
    QKP_MAX_TOPK,
    QKP_VERSION,
    qkp_decode,
    qkp_decode_header,
    qkp_encode,
)

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
# Floats that survive f32 exactly, so a round trip compares equal (NaN never equals itself).
F32 = st.floats(width=32, allow_nan=False)
NAME = st.text(max_size=24)
BYTES32 = st.binary(min_size=32, max_size=32)
TOPK = st.integers(0, QKP_MAX_TOPK)


@st.composite
def rows(draw: st.DrawFn, n: int) -> dict[str, object]:
    """Rows of a RUN/STEP: n token ids, or n hidden rows of a random width."""
    if draw(st.booleans()):
        return {"tokens": draw(st.lists(U32, min_size=n, max_size=n))}
    width = draw(st.integers(1, 6))
    return {"width": width, "hidden": draw(st.lists(F32, min_size=n * width, max_size=n * width))}


STAGE = st.fixed_dictionaries(
    {
        "name": NAME,
        "boot_id": U64,
        "layer_first": U32,
        "layer_end": U32,
        "n_layer": U32,
        "n_embd": U32,
        "slots": U32,
        "ctx": U32,
        "snap_entries": U32,
        "snap_bytes": U64,
        "fingerprint": NAME,
        "adapter": NAME,
    }
)
PAIR = st.tuples(U32, F32)
ENTRY = st.tuples(U32, U32)


@st.composite
def run(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 12))
    base = draw(st.integers(0, 2**32 - 1 - n))
    return {"op": "run", "slot": draw(U32), "base": base, "topk": draw(TOPK), **draw(rows(n))}


@st.composite
def run_reply(draw: st.DrawFn) -> dict[str, object]:
    head = {"op": "run_reply", "slot": draw(U32), "base": draw(U32)}
    n = draw(st.integers(1, 12))
    if draw(st.booleans()):
        return {
            **head,
            "ids": draw(st.lists(U32, min_size=n, max_size=n)),
            "topk": draw(st.lists(PAIR, max_size=8)),
        }
    width = draw(st.integers(1, 6))
    return {**head, "width": width, "hidden": draw(st.lists(F32, min_size=n * width, max_size=n * width))}


@st.composite
def step(draw: st.DrawFn) -> dict[str, object]:
    entries = draw(st.lists(ENTRY, min_size=1, max_size=6))
    return {"op": "step", "topk": draw(TOPK), "entries": entries, **draw(rows(len(entries)))}


@st.composite
def step_reply(draw: st.DrawFn) -> dict[str, object]:
    entries = draw(st.lists(ENTRY, min_size=1, max_size=6))
    n = len(entries)
    if draw(st.booleans()):
        k = draw(st.integers(0, 4))
        topk = draw(st.lists(st.lists(PAIR, min_size=k, max_size=k), min_size=n, max_size=n))
        return {
            "op": "step_reply",
            "entries": entries,
            "ids": draw(st.lists(U32, min_size=n, max_size=n)),
            "topk": topk,
        }
    width = draw(st.integers(1, 6))
    hidden = draw(st.lists(F32, min_size=n * width, max_size=n * width))
    return {"op": "step_reply", "entries": entries, "width": width, "hidden": hidden}


def fixed(op: str, **fields: st.SearchStrategy[object]) -> st.SearchStrategy[dict[str, object]]:
    return st.fixed_dictionaries({"op": st.just(op), **fields})


MESSAGES = st.one_of(
    fixed("hello", nonce=BYTES32, name=NAME, takeover=st.booleans(), has_secret=st.booleans()),
    fixed("challenge", nonce=BYTES32, has_secret=st.booleans()),
    fixed("proof", proof=st.none() | BYTES32),
    fixed("hello_reply", chain=st.lists(STAGE, min_size=1, max_size=4), proof=st.none() | BYTES32),
    run(),
    run_reply(),
    step(),
    step_reply(),
    fixed("save", slot=U32, idx=U32),
    fixed("load", slot=U32, idx=U32),
    fixed("drop", idx=U32),
    fixed("ack", of=st.sampled_from(["save", "load", "drop"]), slot=U32, idx=U32),
    fixed(
        "error",
        code=st.sampled_from(
            ["version", "auth", "busy", "bad_frame", "chain", "stage", "timeout", "taken_over", "unavailable"]
        ),
        stage=NAME,
        message=st.text(max_size=80),
    ),
    fixed("close"),
    fixed("ping", seq=U32),
    fixed("pong", seq=U32),
)


@settings(max_examples=600)
@given(MESSAGES)
def test_random_valid_messages_round_trip_exactly(message: dict[str, object]) -> None:
    frame = qkp_encode(message)
    assert qkp_decode(frame) == message
    header = qkp_decode_header(frame[:QKP_HEADER_LEN])
    assert header["op"] == message["op"]
    assert header["len"] == len(frame) - QKP_HEADER_LEN
    assert frame[:4] == b"qkpf"
    assert struct.unpack_from("<I", frame, 4)[0] == QKP_VERSION


def has_nan(value: object) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, (list, tuple)):
        return any(has_nan(v) for v in value)
    if isinstance(value, dict):
        return any(has_nan(v) for v in value.values())
    return False


def decode_or_refuse(data: bytes) -> None:
    """The decoder's whole contract on arbitrary input: a TransportError, or a message that is the
    one canonical encoding of itself."""
    try:
        message = qkp_decode(data)
    except TransportError:
        return
    # A NaN's payload bits may not survive the trip through a Python float; everything else must.
    if not has_nan(message):
        assert qkp_encode(message) == data


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """One to three random edits: flip bits, cut, append, or overwrite an aligned word (which reaches
    counts, lengths and codes directly)."""
    data = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["flip", "cut", "append", "set32"])
        if kind == "flip" and data:
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        elif kind == "cut":
            del data[rng.randint(0, len(data)) :]
        elif kind == "append":
            data.extend(rng.randbytes(rng.randint(1, 16)))
        elif kind == "set32" and len(data) >= 4:
            pos = rng.randrange(len(data) // 4) * 4
            word = rng.choice([0, 1, 2**32 - 1, rng.getrandbits(32), rng.getrandbits(8), QKP_MAX_ROWS + 1])
            data[pos : pos + 4] = struct.pack("<I", word)
    return bytes(data)


# Each example checks a batch of inputs from a generator seeded by hypothesis (the falsifying example
# names the seed): thousands of inputs in all at a fraction of hypothesis's per-example cost.
BATCH = 16
SEEDED = st.integers(0, 2**64 - 1).map(random.Random)


@settings(max_examples=300)
@given(MESSAGES, SEEDED)
def test_mutated_frames_decode_canonically_or_raise_transport_error(
    message: dict[str, object], rng: random.Random
) -> None:
    frame = qkp_encode(message)
    for _ in range(BATCH):
        decode_or_refuse(mutate(frame, rng))


@settings(max_examples=500)
@given(SEEDED)
def test_random_bytes_raise_transport_error(rng: random.Random) -> None:
    for _ in range(BATCH):
        decode_or_refuse(rng.randbytes(rng.randint(0, 300)))


@settings(max_examples=500)
@given(SEEDED)
def test_random_headers_behind_a_valid_magic_and_version(rng: random.Random) -> None:
    prefix = b"qkpf" + struct.pack("<I", QKP_VERSION)
    for _ in range(BATCH):
        # A known op in the low half-word most of the time, so the per-op checks are reached.
        op = rng.choice([rng.getrandbits(16), *range(1, 5), *range(16, 28)])
        rest = struct.pack("<HH", op, rng.getrandbits(16) if rng.random() < 0.2 else 0)
        # Fields mostly zero or small (unused fields must be zero), and mostly a payload of the announced
        # length, so the per-op checks and the payload decoders are reached, not just the length check.
        fields = [rng.choice([0, 0, 0, 1, rng.getrandbits(4), rng.getrandbits(32)]) for _ in range(5)]
        size = rng.choice([0, 4, 8, rng.randint(0, 120)])
        announced = size if rng.random() < 0.8 else rng.getrandbits(32)
        header = prefix + rest + struct.pack("<6I", *fields, announced)
        decode_or_refuse(header + rng.randbytes(size))


def test_every_truncation_of_a_frame_is_refused() -> None:
    frame = qkp_encode(
        {"op": "run", "slot": 1, "base": 0, "topk": 3, "width": 2, "hidden": [1.0, 2.0, 3.0, 4.0]}
    )
    for cut in range(len(frame)):
        with pytest.raises(TransportError):
            qkp_decode(frame[:cut])


def test_a_foreign_version_names_both_versions() -> None:
    frame = bytearray(qkp_encode({"op": "ping", "seq": 1}))
    frame[4:8] = struct.pack("<I", QKP_VERSION + 3)
    with pytest.raises(TransportError, match=f"version {QKP_VERSION + 3}.*version {QKP_VERSION}"):
        qkp_decode(bytes(frame))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"op": "run", "slot": 0, "base": 0, "topk": QKP_MAX_TOPK + 1, "tokens": [1]}, "top-k 257"),
        ({"op": "run", "slot": 0, "base": 0, "topk": 0, "tokens": [0] * (QKP_MAX_ROWS + 1)}, "n = 4097"),
        ({"op": "run", "slot": 0, "base": 0, "topk": 0, "tokens": []}, "n = 0"),
        ({"op": "run", "slot": 0, "base": 0, "topk": 0, "width": 3, "hidden": [0.0] * 4}, "whole rows"),
        ({"op": "step", "topk": 0, "entries": [(0, 0)], "tokens": [1, 2]}, "1 entries but 2 rows"),
        (
            {
                "op": "hello",
                "nonce": b"\0" * 32,
                "name": "x" * (QKP_MAX_NAME + 1),
                "takeover": False,
                "has_secret": False,
            },
            "cap",
        ),
        (
            {"op": "hello", "nonce": b"\0" * 31, "name": "", "takeover": False, "has_secret": False},
            "31 bytes",
        ),
        ({"op": "hello_reply", "chain": [], "proof": None}, "0 stages"),
        ({"op": "ack", "of": "run", "slot": 0, "idx": 0}, "an ack of run"),
        ({"op": "error", "code": "nope", "stage": "", "message": ""}, "unknown code"),
        ({"op": "frobnicate"}, "unknown op"),
        ({"op": "ping"}, 'missing key "seq"'),
        ({"op": "ping", "seq": 1, "sqe": 2}, 'unknown key "sqe"'),
    ],
)
def test_encode_refuses_invalid_messages_with_transport_error(
    message: dict[str, object], reason: str
) -> None:
    with pytest.raises(TransportError, match=reason):
        qkp_encode(message)
