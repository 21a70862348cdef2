"""The native adapter listing: at least one adapter where a GPU is required (CI), and there the
adapter qk picks is Mesa's lavapipe (llvmpipe), the CPU Vulkan driver CI runs on."""

from __future__ import annotations

import pytest
from conftest import require_gpu

_qk = pytest.importorskip("qk._qk")

pytestmark = pytest.mark.gpu


def test_adapters_are_dicts_with_the_documented_keys() -> None:
    found = _qk.adapters()
    if not found:
        assert not require_gpu(), "QK_REQUIRE_GPU=1 but no Vulkan/Metal adapter is visible"
        pytest.skip("no GPU adapter")
    for a in found:
        assert {"index", "name", "backend", "device_type", "driver"} <= set(a)
        assert a["name"]
        assert a["backend"] in {"vulkan", "metal"}


def test_selected_adapter_is_lavapipe_in_ci() -> None:
    if not _qk.adapters():
        assert not require_gpu()
        pytest.skip("no GPU adapter")
    chosen = _qk.selected_adapter()
    assert chosen["name"] in {a["name"] for a in _qk.adapters()}
    if require_gpu():
        text = f"{chosen['name']} {chosen['driver']}".lower()
        assert "llvmpipe" in text or "lavapipe" in text, chosen


def test_unknown_selector_raises_device_error() -> None:
    if not _qk.adapters():
        pytest.skip("no GPU adapter")
    with pytest.raises(_qk.DeviceError, match="available"):
        _qk.selected_adapter("no-such-adapter-xyz")
