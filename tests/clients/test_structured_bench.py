"""The structured-output bench on the tiny model, scaled down: every reply that was not cut validates."""

import pytest

from clients.structured_bench import cases, main

pytestmark = pytest.mark.slow


def test_cases_are_fifty_distinct_schemas_and_prompts():
    assert len({prompt for prompt, _ in cases()}) == 50


def test_constrained_replies_validate_and_the_cost_table_prints(tiny_model_dir, tmp_path, capsys):
    status = main(["--model", str(tiny_model_dir), "--cases", "5", "--max-tokens", "200", "--cost-tokens", "8",
                   "--rounds", "1", "--log", str(tmp_path / "server.log")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "valid of not truncated" in out and "constrained / free" in out
