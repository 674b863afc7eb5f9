"""Node resources an agent announces: the `--gpus` override numbers devices as CUDA does."""

from __future__ import annotations

import pytest

from phalanx.agent.resources import parse_gpu_override


@pytest.mark.parametrize(
    ("text", "gpus"),
    [
        ("a100:2", [(0, "a100"), (1, "a100")]),
        ("h100:8", [(i, "h100") for i in range(8)]),
        ("a40:2,l4:1", [(0, "a40"), (1, "a40"), (2, "l4")]),
        ("0", []),
        ("", []),
    ],
)
def test_gpu_override_numbers_devices_0_to_n_minus_1(
    text: str, gpus: list[tuple[int, str]]
) -> None:
    assert parse_gpu_override(text) == gpus


@pytest.mark.parametrize("text", ["h100", "h100:x", ":4", "h 100:2"])
def test_gpu_override_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="TYPE:COUNT"):
        parse_gpu_override(text)
