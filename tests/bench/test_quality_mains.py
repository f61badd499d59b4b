"""The quality programs end to end at --limit sizes, on a tiny random model with the real tokenizer:
they parse their flags, read the shared data, and print their tables (values are noise here)."""

import pytest

from h2o_cache.bench import nll, passkey, random_model, rouge
from tests.conftest import shared_data


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-smollm2")
    random_model.main([str(out), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    return str(out)


def test_nll_prints_the_grid_with_intervals_and_targets(tiny_dir, capsys):
    data = shared_data("xsum_dev.jsonl")
    nll.main(["--model", tiny_dir, "--data", str(data), "--limit", "3", "--budgets", "128", "--batch", "2"])
    out = capsys.readouterr().out
    for label in ("| full |", "| h2o 128 |", "| local 128 |", "| streaming 128 |"):
        assert label in out
    assert "- h2o 128 vs full:" in out and "- h2o 128 - local 128:" in out


def test_passkey_prints_every_cell_for_every_cache(tiny_dir, capsys):
    text = shared_data("botchan.txt")
    passkey.main(["--model", tiny_dir, "--text", str(text), "--lengths", "128", "--depths", "0", "0.5",
                  "--keys", "2", "--caches", "full", "h2o:64"])
    out = capsys.readouterr().out
    assert "| 128 tok, depth 0% |" in out and "| 128 tok, depth 50% |" in out and "| mean |" in out
    assert "- h2o:64 at depths >= 50%: " in out  # the goal, checked on the one deep cell
    passkey.main(["--model", tiny_dir, "--text", str(text), "--chat", "1", "--keys", "2", "--fact", "--caches", "h2o:64"])
    assert "| 1 turns |" in capsys.readouterr().out


def test_rouge_prints_differences_from_full(tiny_dir, capsys):
    data = shared_data("xsum_dev.jsonl")
    rouge.main(["--model", tiny_dir, "--data", str(data), "--limit", "2", "--budgets", "64", "--policies", "h2o",
                "--max-new-tokens", "3"])
    assert "| h2o 64 |" in capsys.readouterr().out
