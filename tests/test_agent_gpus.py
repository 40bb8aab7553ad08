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


# -- the engines' measured memory (nvidia-smi's per-process query) ----------------------------
def test_per_process_answer_summed_by_process_group() -> None:
    """Each process's MiB in bytes (a process on two GPUs summed, [N/A] left out), and the
    processes of an engine's session summed for it; a process of no engine's group is left out."""
    used = gpus.parse_apps("101, 1000\n102, 24\n101, 500\n103, [N/A]\n999, 7\n\n")
    assert used == {101: 1500 * 2**20, 102: 24 * 2**20, 999: 7 * 2**20}
    groups = {101: 100, 102: 100, 999: 5}
    assert gpus.by_group(used, groups.get, {100: "big", 7: "idle"}) == {"big": 1524 * 2**20}


def test_per_process_answer_with_no_process() -> None:
    assert gpus.parse_apps("") == {}
    assert gpus.parse_apps("No running processes found\n") == {}


@pytest.mark.parametrize("text", ["101\n", "pid, 12\n", "101, lots\n", "101, 1, 2\n",
                                  "101, nan\n"])
def test_per_process_answers_that_cannot_be_read(text: str) -> None:
    with pytest.raises(gpus.Problem):
        gpus.parse_apps(text)


@given(st.text(alphabet=st.sampled_from("0123456789., -[]N/Aainf\n"), max_size=80))
def test_any_per_process_answer_is_figures_or_a_problem(text: str) -> None:
    """Whatever nvidia-smi prints, parse_apps gives whole byte counts or a Problem."""
    try:
        used = gpus.parse_apps(text)
    except gpus.Problem:
        return
    assert all(isinstance(p, int) and isinstance(b, int) and b >= 0 for p, b in used.items())
