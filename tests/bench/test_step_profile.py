"""`python -m h2o_cache.bench.step_profile` on a tiny batch: it runs and prints its two tables."""

from h2o_cache.bench import step_profile


def test_the_profile_prints_calls_per_step_and_per_row(capsys):
    step_profile.main(["--rows", "4", "--generated", "8", "--steps", "8", "--vocab", "64"])
    out = capsys.readouterr().out
    assert "| batch | Python calls per step | per row |" in out and "| 4 |" in out and "calls per step at batch 4" in out
