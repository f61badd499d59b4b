import math

import pytest
import torch

from h2o_cache import Generator
from h2o_cache import CacheConfig, StaticDecoder
from h2o_cache.bench.speed import fast_table, measure, measure_fast, scenarios, table


def test_measure_times_every_scenario_and_batch(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    timings = [measure(gen, s, b, reps=2, steps=4, warmup=1) for s in scenarios(16, 32, 96, 256) for b in (1, 3)]
    for t in timings:
        assert all(math.isfinite(x) and x > 0 for x in (t.full_ms, t.h2o_ms, t.ratio))
    lines = table(timings, "caption").splitlines()
    assert len(lines) == 4 + len(timings)
    assert all(line.endswith(("| met |", "| MISSED |")) for line in lines[4:])


def test_measure_fast_times_every_decoder_while_rows_evict(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    config = CacheConfig(budget=32)
    decoders = {"fast": StaticDecoder(tiny_model, config, max_rows=3), "other": StaticDecoder(tiny_model, config, max_rows=3)}
    timings = [measure_fast(gen, decoders, b, reps=2, steps=4, warmup=1) for b in (1, 3)]
    for t in timings:
        assert set(t.fast_ms) == set(t.ratio) == set(decoders)
        assert all(math.isfinite(x) and x > 0 for x in (t.eager_ms, *t.fast_ms.values(), *t.ratio.values()))
    for decoder in decoders.values():
        assert decoder.cache.batch_size == 3 and max(decoder.cache.seen) > 32 + 4  # rows crossed the budget
    lines = fast_table(timings, "caption", torch.device("cpu")).splitlines()
    assert "| fast / eager | other ms/step | other / eager | target |" in lines[2]
    assert len(lines) == 4 + len(timings) and all(line.endswith(("| met |", "| MISSED |")) for line in lines[4:])


def test_a_printed_ratio_lies_in_its_printed_interval_however_they_round():
    from h2o_cache.bench.recall_speed import interval_text, ratio_text
    from h2o_cache.bench.stats import Interval

    # a median at its interval's bound (two repetitions): 0.83994 once printed as 0.8399 beside [0.840, ...]
    for value, low, high in [(0.83994, 0.83994, 0.9), (1.23456, 1.2, 1.23456), (1.0005, 1.0005, 1.0005), (2.5, 2.0, 3.0)]:
        ratio = Interval(value, low, high)
        printed_low, printed_high = (float(x) for x in interval_text(ratio).strip("[]").split(","))
        assert printed_low <= low and high <= printed_high  # outward
        assert printed_low <= float(ratio_text(ratio)) <= printed_high


def test_recall_speed_prints_decode_and_prefill_ratios_with_an_archive(tmp_path, capsys):
    from h2o_cache.bench import random_model, recall_speed

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    recall_speed.main(["--model", str(tmp_path), "--budget", "32", "--recall", "16", "--history", "120",
                       "--turn", "8", "--batch-sizes", "1", "2", "--reps", "2", "--steps", "4", "--prompt", "100",
                       "--intervals", "1", "3", "--prefill-reps", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| decode step") or line.startswith("| prefill")]
    assert [row.split(" |")[0] for row in rows] == [
        "| decode step, batch 1, on, every 1", "| decode step, batch 1, on, every 3",
        "| decode step, batch 2, on, every 1 (a row every 2)", "| decode step, batch 2, on, every 3 (a row every 6)",
        "| prefill of a 100-token prompt in chunks of 16, re-reading 96 tokens, body chunks choosing by 32 queries per head (the defaults)",
        "| prefill of a 100-token prompt in chunks of 16, no re-read (recall_reread=0)",
        "| prefill of a 100-token prompt in chunks of 16, re-reading, body chunks choosing by all their queries (recall_queries=None)",
        "| prefill of a 100-token prompt in chunks of 16, no re-read, body chunks given their previous chunk's choice (recall_ahead)"]
    assert all(row.endswith(("| met |", "| MISSED |")) for row in rows)
    for row in rows:  # the median ratio, then its bootstrap interval over the repetitions, which holds it
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        low, high = (float(x) for x in cells[4].strip("[]").split(","))
        assert low <= float(cells[3]) <= high
    assert "Archive after the history: 90 tokens per layer/head" in out


def test_recall_speed_ranks_times_the_steps_and_the_prefill_with_every_held_key_at_its_rank(tmp_path, capsys):
    from h2o_cache.bench import random_model, recall_speed

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    recall_speed.main(["--model", str(tmp_path), "--budget", "32", "--recall", "16", "--history", "120",
                       "--turn", "8", "--batch-sizes", "1", "--reps", "2", "--steps", "4", "--prompt", "60",
                       "--intervals", "1", "--prefill-reps", "1", "--ranks"])
    rows = [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| decode step", "| prefill"))]
    assert "| decode step, batch 1, on, every 1, ranks" in rows
    assert "| prefill of a 60-token prompt in chunks of 16, re-reading, held keys read at their ranks (recall_positions='rank')" in rows


def test_recall_speed_breakdown_times_the_window_without_choices_and_as_many_slots_without_recall(tmp_path, capsys):
    from h2o_cache.bench import random_model, recall_speed

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    recall_speed.main(["--model", str(tmp_path), "--budget", "32", "--recall", "16", "--history", "120",
                       "--turn", "8", "--batch-sizes", "2", "--reps", "2", "--steps", "4", "--prompt", "40",
                       "--intervals", "3", "--prefill-reps", "1", "--breakdown"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| decode step")]
    assert [row.split(" |")[0] for row in rows] == [
        "| decode step, batch 2, on, every 3 (a row every 6)", "| decode step, batch 2, on, never choosing",
        "| decode step, batch 2, off, budget 48"]
    assert rows[0].endswith(("| met |", "| MISSED |"))
    assert all(row.endswith("|  |  |") for row in rows[1:])  # explained, not judged


def test_recall_speed_by_step_sorts_every_timed_step_by_what_it_did_besides_decoding(tmp_path, capsys):
    from h2o_cache.bench import random_model, recall_speed

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    recall_speed.main(["--model", str(tmp_path), "--budget", "32", "--recall", "16", "--history", "120",
                       "--turn", "8", "--batch-sizes", "2", "--reps", "2", "--steps", "4", "--intervals", "1",
                       "--interval-max", "1", "--prefill-reps", "0", "--by-step", "--breakdown"])  # every row every step
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| batch 2,")}
    assert list(rows) == ["batch 2, off", "batch 2, on, every 1", "batch 2, on, never choosing",
                          "batch 2, off, budget 48"]
    counts = {name: [int(cell.split("(")[1].rstrip(")")) if cell.strip() else 0 for cell in cells[:3]]
              for name, cells in rows.items()}
    assert all(sum(c) == 2 * 4 for c in counts.values())  # every timed step, sorted once
    assert counts["batch 2, on, every 1"] == [0, 8, 0]  # a choice before every step
    assert counts["batch 2, off"][1] == counts["batch 2, on, never choosing"][1] == 0
    assert counts["batch 2, off"][2] > 0  # rows over the budget were evicted within the timed steps


def test_the_digests_bench_scores_every_digest_and_block_on_a_random_model(tmp_path, capsys):
    """On a tiny random model: every digest x block row and every layer printed, each share in [0, 1],
    and more candidates never find less."""
    from h2o_cache.bench import digests, random_model

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    words = [f"word{i % 97} {i}" for i in range(3000)]  # no data file needed: a text of numbered words
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words))
    digests.main(["--model", str(tmp_path), "--text", str(text), "--budget", "32", "--recall", "16",
                  "--history", "400", "--steps", "2", "--offsets", "0", "5000", "--candidates", "64", "128"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| centre |", "| mean |", "| minmax |"))]
    assert [(row[0], row[1]) for row in rows] == [(f"| {kind}", str(block)) for kind in ("centre", "mean", "minmax")
                                                  for block in (8, 16, 32)]
    for row in rows:
        (r64, m64), (r128, m128) = (tuple(float(x) for x in cell.strip(" |").split(" / ")) for cell in row[2:])
        assert 0 <= r64 <= r128 <= 1 and 0 <= m64 <= m128 <= 1
    assert sum(line.startswith(("| 0 |", "| 1 |")) for line in out.splitlines()) == 2


def test_recall_speed_times_the_prefill_alone_with_no_decode_repetitions_and_refuses_none_of_either(tmp_path, capsys):
    import pytest

    from h2o_cache.bench import random_model, recall_speed

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    recall_speed.main(["--model", str(tmp_path), "--budget", "32", "--recall", "16", "--history", "120",
                       "--turn", "8", "--reps", "0", "--prompt", "40", "--prefill-reps", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert not any(row.startswith("| decode step") for row in rows)
    assert sum(row.startswith("| prefill of a 40-token prompt") for row in rows) == 4  # the defaults, no re-read, all queries, ahead
    with pytest.raises(SystemExit):
        recall_speed.main(["--model", str(tmp_path), "--reps", "0", "--prefill-reps", "0"])
    assert "one of them must be at least 1" in capsys.readouterr().err


def test_flat_times_replies_at_each_history_with_ratios_to_the_shortest(tmp_path, capsys):
    from h2o_cache.bench import flat, random_model

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    flat.main(["--model", str(tmp_path), "--text", "random", "--budget", "32", "--recall", "16",
               "--histories", "150", "60", "--turn", "8", "--reply", "6", "--reps", "2", "--digests", "mean", "centre",
               "--sweeps", "0", "--variants", "recall_burst=0,recall_positions=text"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| recall")]
    default = "| recall 16, digest centre, sweep 512 (default)"
    variant = "| recall 16, recall_burst=0,recall_positions=text"
    assert [(row[0], row[1]) for row in rows] == [
        ("| recall off", "60"), ("| recall off", "150"), (default, "60"), (default, "150"),
        ("| recall 16, digest mean", "60"), ("| recall 16, digest mean", "150"),
        ("| recall 16, sweep 0", "60"), ("| recall 16, sweep 0", "150"), (variant, "60"), (variant, "150")]
    assert [row[2] for row in rows] == ["0", "0", "30", "120", "30", "120", "30", "120", "30", "120"]  # the history less the target (30)
    assert all(float(row[3]) > 0 for row in rows) and [float(row[4]) for row in rows[::2]] == [1.0] * 5
    assert [float(row[5].rstrip(" |")) for row in rows[:2]] == [1.0, 1.0]  # recall off against itself
    assert all(float(row[5].rstrip(" |")) > 0 for row in rows)
    for bad in ("recall_burst", "recall_bursts=0", "recall_burst=many"):  # no value, no such field, not an int
        with pytest.raises(SystemExit):
            flat.main(["--model", str(tmp_path), "--text", "random", "--histories", "60", "--variants", bad])


def test_flat_phases_split_each_replys_steps_by_what_recall_does_in_them(tmp_path, capsys):
    """`--phases`: every step of a 40-step reply lands in one phase (step 0; 1-15 the burst; 16-31 at
    ranks; 32-39 after), each with a time and a forward pass no longer than it."""
    from h2o_cache.bench import flat, random_model

    assert [flat.phase_of(step) for step in (0, 1, 15, 16, 31, 32)] == [
        "first", "burst", "burst", "ranks", "ranks", "after"]
    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    flat.main(["--model", str(tmp_path), "--text", "random", "--budget", "32", "--recall", "16",
               "--histories", "80", "--turn", "8", "--reply", "40", "--reps", "1", "--phases"])
    out = capsys.readouterr().out
    table = out[out.index("Each step of those replies"):]
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| recall")]
    assert [row[:2] for row in rows] == [["recall off", "80"], ["recall 16, digest centre, sweep 512 (default)", "80"]]
    for row in rows:
        for cell in row[2:]:
            step, forward = (float(x.strip("()")) for x in cell.split())
            assert step > 0 and 0 <= forward <= step


def test_choice_cost_times_the_choices_of_a_reply_at_each_history_and_sweep(tmp_path, capsys):
    from h2o_cache.bench import choice_cost, random_model

    random_model.main([str(tmp_path), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    choice_cost.main(["--model", str(tmp_path), "--text", "random", "--budget", "32", "--recall", "16",
                      "--histories", "400", "120", "--sweeps", "0", "4", "--choices", "3", "--reps", "2"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1") or line.startswith("| 4")]
    assert [(row[0], row[1], row[2]) for row in rows] == [("| 120", "90", "0"), ("| 120", "90", "4"),
                                                         ("| 400", "370", "0"), ("| 400", "370", "4")]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
    assert all(int(row[5].split(" / ")[0]) > 0 for row in rows)  # a burst's choices rewrite slots
    with pytest.raises(SystemExit):
        choice_cost.main(["--model", str(tmp_path), "--choices", "1"])



def test_recall_speed_split_times_the_native_forward_pass_apart_from_the_choice_around_it(tmp_path):
    """`--split`: a native decoder's forward calls are timed by a stand-in that passes them through
    (the same logits), and each window's forward seconds are a part of its step's."""
    from h2o_cache import Generator, StaticDecoder, native_recall
    from h2o_cache.bench.recall_speed import ForwardTimer, decode_times, stage_rows
    from h2o_cache.bench.speed import greedy_step_seconds
    from h2o_cache.quantized import kernel
    from tests.conftest import ByteTokenizer, tiny_llama
    from tests.h2o_cache.test_quantized import gguf_llama
    from tests.h2o_cache.test_recall import recall_config, recalling_rows

    if kernel() is None:
        pytest.skip("no C++ compiler: no native step to time")
    model = tiny_llama(init_std=0.3)
    gguf_llama(tmp_path / "tiny.gguf", model)
    model.gguf_path = tmp_path / "tiny.gguf"
    config = recall_config()
    gen = Generator(model, ByteTokenizer(), config)
    timed, plain = (StaticDecoder(model, config, max_rows=1, exact=True) for _ in range(2))
    assert timed.native is not None
    recalling_rows(gen, (50,), [timed, plain])
    timed.native = ForwardTimer(timed.native)
    for _ in range(6):  # the stand-in changes nothing the step computes
        logits = plain.step()
        assert torch.equal(timed.step(), logits)
        token = int(logits[0].argmax())
        timed.cache.pending, plain.cache.pending = [[token]], [[token]]
    forward: dict[str, list[float]] = {}
    stages: dict[str, dict[str, float]] = {}
    times = decode_times({"timed": timed, "plain": plain}, reps=3, steps=4, forward=forward, stages=stages)
    assert list(forward) == ["timed"] and len(forward["timed"]) == 3  # only a decoder with a stand-in
    assert all(0 < f < t for f, t in zip(forward["timed"], times["timed"]))
    # the kernel's choices in each decoder's windows, by stage: one a step (recall_interval 1), each
    # decoder's counted apart, a choice's stages within its window's time
    assert set(stages) == {"timed", "plain"}
    for name, counted in stages.items():
        assert counted["choices"] == 3 * 4
        choice = sum(counted[stage] for stage in native_recall.STAGES)
        assert 0 < choice < sum(times[name]) * 4
    rows = stage_rows(stages, batch=1, steps=3 * 4)
    assert [row[:2] for row in rows] == [["batch 1, timed", 1.0], ["batch 1, plain", 1.0]]
    left = native_recall.stages()
    greedy_step_seconds(timed.step, timed.cache, 2)  # counting was left off: these choices are not counted
    assert native_recall.stages() == left
    # warm steps run before each timed window, neither timed nor counted: the choices counted are the
    # timed steps' alone, while every decoder decoded the warm steps too
    seen = {name: d.cache.seen[0] for name, d in (("timed", timed), ("plain", plain))}
    forward, stages = {}, {}
    decode_times({"timed": timed, "plain": plain}, reps=2, steps=3, forward=forward, stages=stages, warm=2)
    assert timed.cache.seen[0] - seen["timed"] == plain.cache.seen[0] - seen["plain"] == 2 * (3 + 2)
    assert all(counted["choices"] == 2 * 3 for counted in stages.values())
    assert len(forward["timed"]) == 2


def test_recall_speed_rotates_its_decoders_order_at_each_repetition(monkeypatch):
    """Windows in one fixed order put each decoder after the same other one every time, which moved a
    ratio by 0.1-0.15 on the project's VM: each repetition begins one decoder further on, and every
    decoder's windows are still timed once a repetition, under its own name."""
    from types import SimpleNamespace

    from h2o_cache.bench import recall_speed

    calls = []

    def timed(step, cache, steps):
        calls.append(cache)
        return {"a": 1.0, "b": 2.0, "c": 3.0}[cache] + len(calls) / 100

    monkeypatch.setattr(recall_speed, "greedy_step_seconds", timed)
    decoders = {name: SimpleNamespace(step=None, cache=name, native=None) for name in "abc"}
    times = recall_speed.decode_times(decoders, reps=4, steps=2)
    assert "".join(calls) == "abc" "bca" "cab" "abc"
    assert times == {"a": [1.01, 1.06, 1.08, 1.10], "b": [2.02, 2.04, 2.09, 2.11], "c": [3.03, 3.05, 3.07, 3.12]}


def test_recall_speed_rotates_its_prefill_configurations_at_each_repetition():
    """The prefill's configurations, like the decoders, begin one further on each repetition (the first
    round warms up and is not kept)."""
    from types import SimpleNamespace

    from h2o_cache.bench import recall_speed

    calls = []
    gen = SimpleNamespace(spec=SimpleNamespace(device=torch.device("cpu")),
                          new_cache=lambda rows, config: config,
                          prefill=lambda row, prompts, recall: calls.append(row))
    times = recall_speed.prefill_times(gen, {"a": "a", "b": "b", "c": "c"}, [1, 2, 3], reps=3)
    assert "".join(calls) == "abc" "bca" "cab" "abc"
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_flat_rotates_its_rows_at_each_repetition(monkeypatch):
    """The flat bench's replies, one per configuration and history each repetition, begin one row
    further on each repetition; each row's replies are still timed under its own name."""
    from types import SimpleNamespace

    from h2o_cache.bench import flat

    order = []

    def reply(gen, config, row, turn, steps, phases):
        order.append(row.name)
        return 0.001 * len(order)

    monkeypatch.setattr(flat, "load", lambda args: (SimpleNamespace(config=SimpleNamespace(vocab_size=100)), None))
    monkeypatch.setattr(flat, "Generator", lambda model, tokenizer: SimpleNamespace(
        spec=SimpleNamespace(device=torch.device("cpu"))))
    monkeypatch.setattr(flat, "conversation_row", lambda gen, config, tokens: SimpleNamespace(
        name=f"{config.recall_budget}:{len(tokens)}", archives=[None]))
    monkeypatch.setattr(flat, "reply_seconds", reply)
    flat.main(["--text", "random", "--histories", "10", "20", "--reps", "3", "--turn", "2", "--reply", "1"])
    rows = ["0:10", "0:20", "128:10", "128:20"]
    assert order == rows + rows[1:] + rows[:1] + rows[2:] + rows[:2]
