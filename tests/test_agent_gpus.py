"""The GPU figures of the agent's watch, read from nvidia-smi's CSV answer: MiB in bytes,
percent as a ratio, [N/A] as null, and any answer that cannot be read a Problem naming its
kind (the watch warns once per kind)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmproxy.agent import gpus


@pytest.mark.parametrize(("text", "key"), [
    ("0, GPU, 1, 2, 3\n", "fields"),
    ("x, GPU, 1, 2, 3, 4, 5\n", "fields"),
    ("0, GPU, lots, 2, 3, 4, 5\n", "value:memory.used"),
    ("0, GPU, 1, 2, 3, nan, 5\n", "value:temperature.gpu"),
    ("0, GPU, 1, inf, 3, 4, 5\n", "value:memory.total"),
])
def test_gpu_answers_that_cannot_be_read(text: str, key: str) -> None:
    """A line with too few fields, no index, or a figure that is not a number is a Problem
    naming its kind."""
    with pytest.raises(gpus.Problem) as caught:
        gpus.parse(text)
    assert caught.value.key == key


def test_gpu_answer_names_with_commas_and_unsupported_figures() -> None:
    """A name holding a comma stays whole; [Not Supported] and [N/A] are null."""
    [gpu] = gpus.parse("3, Tesla, rev. B, [N/A], 16384, [Not Supported], 33, [N/A]\n\n")
    assert gpu == {"index": 3, "name": "Tesla, rev. B", "memory_used_bytes": None,
                   "memory_total_bytes": 16384 * 2**20, "utilization_ratio": None,
                   "temperature_celsius": 33.0, "power_watts": None}


@given(st.text(alphabet=st.sampled_from("0123456789., -[]N/Aainf\n"), max_size=80))
def test_any_gpu_answer_is_figures_or_a_problem(text: str) -> None:
    """Whatever nvidia-smi prints, parse gives GPUs with whole byte counts or a Problem, never
    another exception (which would end the GPU thread)."""
    try:
        found = gpus.parse(text)
    except gpus.Problem:
        return
    for gpu in found:
        assert type(gpu["index"]) is int
        assert gpu["memory_used_bytes"] is None or type(gpu["memory_used_bytes"]) is int
