"""Split serving between two network hosts: the worker runs in its own network namespace, reached over
a veth pair as a separate address (not loopback), so it must be given a shared secret to listen there
— and the head, with the same secret, serves the same bytes as the unsplit server. Needs root (to
create the namespace); elsewhere the loopback gates of test_split_serve cover the same code."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from conftest import free_port
from test_server_engine import live as _live_fixture  # noqa: F401 (a fixture)
from test_split_serve import N_LAYER, head, normalise, wait_health, worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SECRET = "netns-test-secret"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def other_host():
    """A network namespace with a veth pair to this one: (namespace, its address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 10000}"
    ns, here, there = f"qk-ns{tag}", f"qkh{tag}", f"qkw{tag}"
    octet = 16 + os.getpid() % 200
    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"10.{octet}.7.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"10.{octet}.7.2/24", "dev", there)
        ip("netns", "exec", ns, "ip", "link", "set", there, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, f"10.{octet}.7.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_worker_on_another_host_with_a_secret(_live_fixture, other_host):  # noqa: F811
    unsplit = _live_fixture[0]
    ns, addr = other_host
    there = ("ip", "netns", "exec", ns)
    port, head_port = free_port(), free_port()
    # Without a secret a worker refuses to listen on a non-loopback address.
    refused = worker((2, N_LAYER), port, "--host", addr, prefix=there)
    assert refused.proc.wait(60) == 2 and "secret" in refused.output()
    refused.stop()
    w = worker((2, N_LAYER), port, "--host", addr, "--secret", SECRET, prefix=there)
    h = head(2, port, head_port, "--secret", SECRET, next_host=addr)
    try:
        url = f"http://127.0.0.1:{head_port}"
        health = wait_health(url, [h, w])
        assert [s["layers"] for s in health["stages"]] == [[0, 2], [2, N_LAYER]]
        body = {"prompt": "Once upon a time " * 10, "n_predict": 12}
        with httpx.Client(base_url=url, timeout=120) as c:
            got = c.post("/completion", json=body)
        want = unsplit.http.post("/completion", json=body)
        assert got.status_code == 200, got.text
        assert normalise(got.json()) == normalise(want.json())
    finally:
        h.stop()
        w.stop()
