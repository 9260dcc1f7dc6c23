"""The table cost model: the shipped example grid, exactness at grid points, interpolation between
them, clamping outside, and errors that name file, line and field."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from contbatch.core.outputs import ScheduledChunk, SchedulerOutput, build_output
from contbatch.sim.cost import CostSpecError, parse_cost
from contbatch.sim.costs import TableCost, load_table

EXAMPLE = Path(__file__).with_name("cost_table_example.csv")
HEADER = "num_prefill_tokens,num_decode_tokens,num_context_tokens,step_ms\n"


def shape(prefill: int, decode: int, context: int, padding: int = 0) -> SchedulerOutput:
    """A step with these totals (the table reads nothing else)."""
    return SchedulerOutput(0, (), prefill + decode, prefill, decode, context, padding, num_requests=0)


def rows_of(path: Path) -> list[tuple[int, int, int, float]]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")][1:]
    return [(int(p), int(d), int(c), float(ms)) for p, d, c, ms in (line.split(",") for line in lines)]


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_example_is_exact_at_every_grid_point() -> None:
    table = load_table(EXAMPLE)
    assert (table.prefill_axis, table.decode_axis, table.context_axis) == ((0, 512, 2048), (0, 32, 256), (1024, 32768))
    for p, d, c, ms in rows_of(EXAMPLE):
        assert table.lookup_ms(p, d, c) == ms
        assert table.step_time(shape(p, d, c)) == ms / 1000.0
    assert table.time_unit == "s" and table.source == str(EXAMPLE)


def test_bilinear_between_grid_points() -> None:
    table = load_table(EXAMPLE)
    v = {(p, d): ms for p, d, c, ms in rows_of(EXAMPLE) if c == 1024}
    assert table.lookup_ms(256, 0, 1024) == pytest.approx((v[0, 0] + v[512, 0]) / 2)
    assert table.lookup_ms(0, 144, 1024) == pytest.approx((v[0, 32] + v[0, 256]) / 2)
    middle = table.lookup_ms(256, 144, 1024)
    assert middle == pytest.approx((v[0, 32] + v[0, 256] + v[512, 32] + v[512, 256]) / 4)
    # sane between: within the bracketing cell's values, monotonic where the grid is
    for p, d in itertools.product((1, 100, 511, 700, 2000), (1, 20, 100, 255)):
        value = table.lookup_ms(p, d, 1024)
        assert min(v.values()) <= value <= max(v.values())
    series = [table.lookup_ms(p, 32, 1024) for p in range(0, 2049, 64)]
    assert series == sorted(series)


def test_context_picks_the_nearest_slice_and_edges_clamp() -> None:
    table = load_table(EXAMPLE)
    low, high = table.lookup_ms(0, 32, 1024), table.lookup_ms(0, 32, 32768)
    assert table.lookup_ms(0, 32, 5000) == low
    assert table.lookup_ms(0, 32, 30000) == high
    assert table.lookup_ms(0, 32, (1024 + 32768) // 2) == low  # a tie goes to the smaller context
    assert table.lookup_ms(0, 32, 10**7) == high
    assert table.lookup_ms(10**6, 10**6, 1024) == table.lookup_ms(2048, 256, 1024)  # clamped, never extrapolated


def test_padding_counts_as_prefill_and_swaps_add_per_block(tmp_path: Path) -> None:
    table = load_table(EXAMPLE, swap_ms_per_block=0.5)
    assert table.step_time(shape(256, 0, 1024, padding=256)) == table.step_time(shape(512, 0, 1024))
    step = build_output(0, [ScheduledChunk("a", 99, 1, False, True)], swapped_out=(("b", (1, 2)),))
    plain = build_output(0, [ScheduledChunk("a", 99, 1, False, True)])
    assert table.step_time(step) - table.step_time(plain) == pytest.approx(1.0e-3)


def test_context_column_is_optional(tmp_path: Path) -> None:
    path = write(tmp_path, "step_ms,num_decode_tokens,num_prefill_tokens\n10,0,0\n20,100,0\n30,0,100\n40,100,100\n")
    table = load_table(path)
    assert table.context_axis == (0,)
    assert table.lookup_ms(50, 50, 123456) == pytest.approx(25.0)


def test_parse_cost_reads_tables(tmp_path: Path) -> None:
    cost = parse_cost(f"table:{EXAMPLE}")
    assert isinstance(cost, TableCost) and cost.swap_ms_per_block == 0.32
    cost = parse_cost(f"table:{EXAMPLE},swap_ms_per_block=1.5")
    assert isinstance(cost, TableCost) and cost.swap_ms_per_block == 1.5
    odd = write(tmp_path, EXAMPLE.read_text(), name="a,b.csv")  # commas in a path survive
    assert parse_cost(f"table:{odd}") == load_table(odd)
    with pytest.raises(CostSpecError, match="swap_ms_per_block"):
        parse_cost(f"table:{EXAMPLE},swap=1")
    with pytest.raises(CostSpecError, match="expected table:PATH"):
        parse_cost("table:")


@pytest.mark.parametrize(
    ("text", "where", "needle"),
    [
        ("", ":", "empty file"),
        ("# only a comment\n", ":", "empty file"),
        (HEADER, ":", "no data rows"),
        (HEADER.replace("step_ms", "ms"), ":1: field 'ms'", "unknown column"),
        ("num_prefill_tokens,num_decode_tokens\n1,2\n", ":1: field 'step_ms'", "missing required column"),
        (
            "num_prefill_tokens,num_prefill_tokens,num_decode_tokens,step_ms\n",
            ":1: field 'num_prefill_tokens'",
            "twice",
        ),
        (HEADER + "0,1,10,5\n0,1,x,5\n", ":3: field 'num_context_tokens'", "integer"),
        (HEADER + "0,-1,10,5\n", ":2: field 'num_decode_tokens'", "integer"),
        (HEADER + "0,1,10,0\n", ":2: field 'step_ms'", "> 0"),
        (HEADER + "0,1,10,nan\n", ":2: field 'step_ms'", "> 0"),
        (HEADER + "0,1,10,\n", ":2: field 'step_ms'", "> 0"),
        (HEADER + "0,1,10\n", ":2:", "3 cells, header has 4"),
        (HEADER + "0,1,10,5\n\n0,1,10,6\n", ":4:", "duplicate grid point"),
        (HEADER + "0,1,10,5\n0,2,10,5\n8,1,10,5\n", ":", "no row for (num_prefill_tokens=8, num_decode_tokens=2"),
        (HEADER + '0,1,10,"5\n', ":", "malformed CSV"),
    ],
)
def test_malformed_files_name_file_line_and_field(tmp_path: Path, text: str, where: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(CostSpecError) as info:
        load_table(path)
    message = str(info.value)
    assert message.startswith(f"{path}{where}"), message
    assert needle in message


def test_missing_and_undecodable_files(tmp_path: Path) -> None:
    with pytest.raises(CostSpecError, match="no such file"):
        load_table(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CostSpecError, match="UTF-8"):
        load_table(bad)


def test_constructor_checks_the_grid() -> None:
    with pytest.raises(CostSpecError, match="strictly increasing"):
        TableCost((0, 0), (1,), (0,), (1.0, 1.0))
    with pytest.raises(CostSpecError, match="need 2"):
        TableCost((0, 1), (1,), (0,), (1.0,))
    with pytest.raises(CostSpecError, match="> 0"):
        TableCost((0,), (1,), (0,), (0.0,))
