"""bench/plan_check.py's --layout: the plan's layout names, tensor-parallel sizes included, back into layouts."""

from __future__ import annotations

import pytest

from bench.plan_check import parse_layout
from deploy.planner.planner import Layout


@pytest.mark.parametrize(("text", "layout"), [
    ("1P+1D", Layout(num_prefill=1, num_decode=1, max_num_seqs=16, transport="grpc")),
    ("1P(TP2)+2D", Layout(num_prefill=1, num_decode=2, max_num_seqs=16, transport="grpc", prefill_tp=2)),
    ("2P+1D(TP3)", Layout(num_prefill=2, num_decode=1, max_num_seqs=16, transport="grpc", decode_tp=3)),
    ("colocatedx2", Layout(num_colocated=2, max_num_seqs=16)),
    ("colocated(TP2)x1", Layout(num_colocated=1, max_num_seqs=16, tp=2)),
])
def test_a_layout_named_as_the_plan_names_it_reads_back(text: str, layout: Layout) -> None:
    assert parse_layout(text, 16) == layout
    assert layout.label.replace(" ", "").startswith(text)  # the name the plan's table gives it


def test_anything_else_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--layout: NP\\+MD or colocatedxN"):
        parse_layout("1P(TP)+1D", 16)
