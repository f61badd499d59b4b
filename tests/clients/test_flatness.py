"""The flatness table: per-turn times, blocks, growth with intervals, and ratios to a reference that
cancel a drifting machine."""

import re

import pytest

from clients.flatness import blocks, growth, table, turn_ms


def run(label, times, tokens=64):
    """CSV rows as the demo writes them: `times` ms per token at turns 1, 2, ..."""
    return [{"label": label, "turn": str(n), "decode_tokens_per_s": str(1000 / ms), "completion_tokens": str(tokens),
             "error": ""} for n, ms in enumerate(times, 1)]


def test_short_replies_and_failures_are_not_timed():
    rows = run("a", [10.0, 20.0, 30.0])
    rows[1]["completion_tokens"] = "4"  # a 4-token reply's rate is a few frames' gaps
    rows.append({"label": "a", "turn": "4", "decode_tokens_per_s": "", "completion_tokens": "", "error": "boom"})
    assert turn_ms(rows) == pytest.approx({1: 10.0, 3: 30.0})
    assert turn_ms(rows, min_tokens=4) == pytest.approx({1: 10.0, 2: 20.0, 3: 30.0})


def test_blocks_start_at_turn_one():
    assert blocks({1: 1.0, 2: 2.0, 3: 3.0, 5: 5.0}, 2) == {1: [1.0, 2.0], 3: [3.0], 5: [5.0]}


def test_growth_is_the_ratio_of_medians_and_its_interval_holds_it():
    first = [10.0, 10.5, 9.5, 10.2, 9.8, 10.1]
    value, low, high = growth(first, [2 * x for x in first])
    assert value == pytest.approx(2.0) and low <= 2.0 <= high
    value, low, high = growth(first, list(first))
    assert value == pytest.approx(1.0) and low < 1.0 < high  # no growth, and the interval says so
    value, low, high = growth(first, [x + 3 for x in first])
    assert low > 1.0  # a clear rise is resolved


def test_a_reference_cancels_the_machine_s_drift():
    # the machine slows by 30% over the run; the server's own cost is flat: 1.5x the reference's every turn
    drift = [1 + 0.3 * n / 39 for n in range(40)]
    noise = [1 + 0.02 * ((n * 7) % 5 - 2) for n in range(40)]
    reference = [8.0 * d for d in drift]
    server = [12.0 * d * e for d, e in zip(drift, noise)]
    text = table({"recall": run("recall", server), "h2o": run("h2o", reference)}, reference="h2o", block=20)
    lines = text.splitlines()
    assert lines[0].startswith("turns | recall (ms") and "recall / h2o (ratio" in lines[0]
    second = lines[3].split(" | ")
    assert second[0] == "21-40"
    cell = re.compile(r"[\d.]+, 20, ([\d.]+) \[([\d.]+), ([\d.]+)\]")
    absolute = float(cell.fullmatch(second[1]).group(1))
    ratio, low, high = (float(x) for x in cell.fullmatch(second[3]).groups())
    assert absolute > 1.1  # the machine's drift, alone
    assert ratio == pytest.approx(1.0, abs=0.03) and low <= 1.0 <= high  # the server's own: flat
    assert lines[2].split(" | ")[3] == "1.500, 20"  # the first block: its median ratio and count, no growth


def test_a_reference_that_is_not_a_run_is_an_error():
    with pytest.raises(ValueError, match="no run labelled 'full'"):
        table({"h2o": run("h2o", [1.0])}, reference="full")
