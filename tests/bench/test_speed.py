import math

from h2o_cache import Generator
from h2o_cache.bench.speed import measure, scenarios, table


def test_measure_times_every_scenario_and_batch(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    timings = [measure(gen, s, b, reps=2, steps=4, warmup=1) for s in scenarios(16, 32, 96, 256) for b in (1, 3)]
    for t in timings:
        assert all(math.isfinite(x) and x > 0 for x in (t.full_ms, t.h2o_ms, t.ratio))
    lines = table(timings, "caption").splitlines()
    assert len(lines) == 4 + len(timings)
    assert all(line.endswith(("| met |", "| MISSED |")) for line in lines[4:])
