"""A worker spends next to nothing on a peer that has not proved the shared secret: generated raw frame
headers sent instead of a hello (any op, any field, payloads announced up to 256 MiB) are refused
from the header alone — an ERROR at once, no payload awaited — and the worker then serves a real
head; hundreds of idle sockets cost at most ``max_pending`` threads, each for ``pre_auth_timeout``.
Real ``qk._qk.Worker`` serving a test-double stage over loopback."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_qk = pytest.importorskip("qk._qk")
from test_split_link import N_LAYER, DoubleStage, Serving, link_to  # noqa: E402

SECRET = "s3cret"
HELLO = 1
PROOF = 3
ERROR = 24


@pytest.fixture(scope="module")
def worker():
    w = Serving(DoubleStage(2, N_LAYER), "w1", secret=SECRET, pre_auth_timeout=5.0)
    yield w
    w.stop()


def read_reply(sock: socket.socket) -> bytes:
    """Everything the worker sends before it closes (or 3 s pass)."""
    sock.settimeout(3)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


FIELDS = st.sampled_from([0, 1, 7, 255, 4096, 16384, 2**31, 2**32 - 1])
HEADER = st.tuples(
    # Every op but a hello (whose valid header makes the worker wait for the hello's payload).
    st.sampled_from([op for op in range(0, 30) if op != HELLO]),
    st.integers(0, 2**16 - 1),
    FIELDS,
    FIELDS,
    FIELDS,
    FIELDS,
    FIELDS,
    st.one_of(FIELDS, st.just(4096 * 16384 * 4)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=HEADER)
def test_a_raw_header_before_the_hello_is_refused_from_the_header(worker, header):
    op, flags, slot, n, base, arg, width, length = header
    raw = b"qkpf" + struct.pack("<IHHIIIIII", _qk.QKP_VERSION, op, flags, slot, n, base, arg, width, length)
    with socket.create_connection(("127.0.0.1", worker.worker.port)) as sock:
        start = time.monotonic()
        sock.sendall(raw)
        reply = read_reply(sock)
        elapsed = time.monotonic() - start
    # Refused at once, not after waiting for a payload or for the pre-auth time (5 s).
    assert elapsed < 2.0, (header, elapsed)
    assert _qk.qkp_decode_header(reply[:36])["op"] == "error", (header, reply[:64])
    message = _qk.qkp_decode(reply)["message"]
    assert "bad frame" in message, message


def test_a_head_is_served_after_the_junk(worker):
    link = link_to(worker.addr, DoubleStage(0, 2), secret=SECRET)
    assert link.ping() > 0
    link.close()


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_idle_sockets_cost_few_threads_and_little_time():
    w = Serving(DoubleStage(2, N_LAYER), "w1", secret=SECRET, pre_auth_timeout=0.5, max_pending=8)
    try:
        # Counted once the worker serves: its acceptor thread starts only after the stage has
        # described itself, which waits for this thread to let go of the GIL.
        link = link_to(w.addr, DoubleStage(0, 2), secret=SECRET)
        assert link.ping() > 0
        link.close()
        time.sleep(0.3)
        before = threads()
        idle = [socket.create_connection(("127.0.0.1", w.worker.port)) for _ in range(200)]
        time.sleep(0.3)
        during = threads()
        # One hello thread per pending connection, at most max_pending of them.
        assert during - before <= 8, (before, during)
        # The rest were refused at once; the pending ones are closed once their 0.5 s are up.
        start = time.monotonic()
        for s in idle:
            read_reply(s)
            s.close()
        assert time.monotonic() - start < 4
        time.sleep(0.3)
        assert threads() - before <= 1, (before, threads())
        link = link_to(w.addr, DoubleStage(0, 2), secret=SECRET)
        assert link.ping() > 0
        link.close()
    finally:
        w.stop()
