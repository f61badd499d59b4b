"""Settings: every field has a default and a description, reads a flag and an H2O_* variable."""

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from h2o_cache import CacheConfig
from server.settings import ServerSettings

FLAGS = ["--host", "--port", "--model", "--device", "--dtype", "--policy", "--kv-budget", "--heavy-ratio",
         "--sink-tokens", "--no-position-rolling", "--max-batch-size", "--max-queue", "--max-sessions",
         "--session-ttl", "--api-key", "--max-prompt-tokens", "--prefill-chunk", "--threads", "--served-model-name",
         "--recall-budget", "--recall-block", "--recall-archive", "--recall-probe", "--recall-queries",
         "--recall-ahead", "--recall-voters", "--recall-digest", "--recall-positions"]


def parse(*args: str) -> ServerSettings:
    return CliApp.run(ServerSettings, cli_args=list(args))


def test_every_field_has_a_default_and_a_description():
    for name, field in ServerSettings.model_fields.items():
        assert not field.is_required(), name
        assert field.description and len(field.description) > 10, name
    assert ServerSettings().host == "127.0.0.1" and ServerSettings().port == 8000


def test_help_lists_every_flag_with_its_description(capsys):
    with pytest.raises(SystemExit) as exit:
        parse("--help")
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in text, flag
    assert "tokens each layer/KV head keeps" in text


def test_flags_reach_the_cache_and_engine_configs():
    s = parse("--policy", "streaming", "--kv-budget", "64", "--heavy-ratio", "0.25", "--sink-tokens", "2",
              "--evict-slack", "8", "--no-position-rolling", "--max-batch-size", "4", "--max-queue", "9", "--max-sessions", "3",
              "--session-ttl", "60", "--max-prompt-tokens", "1000", "--prefill-chunk", "32",
              "--prefill-tokens", "96", "--enforce-eager", "--exact")
    assert s.cache_config() == CacheConfig(policy="streaming", budget=64, heavy_ratio=0.25, sink_tokens=2,
                                           evict_slack=8, position_rolling=False, prefill_chunk=32)
    engine = s.engine_config(context_window=2048)
    assert (engine.max_batch_size, engine.max_queue, engine.max_sessions, engine.session_ttl) == (4, 9, 3, 60.0)
    assert (engine.max_prompt_tokens, engine.prefill_tokens, engine.enforce_eager, engine.context_window) == (
        1000, 96, True, 2048)
    assert engine.exact and not parse().engine_config(context_window=None).exact


def test_recall_flags_reach_the_cache_config_and_recall_is_on_by_default_where_it_applies():
    from server.settings import DEFAULT_RECALL

    assert parse().cache_config().recall_budget == DEFAULT_RECALL
    assert parse("--policy", "full").cache_config().recall_budget == 0
    assert parse("--no-position-rolling").cache_config().recall_budget == 0
    assert parse("--recall-budget", "0").cache_config().recall_budget == 0
    s = parse("--recall-budget", "64", "--recall-block", "8", "--recall-archive", "4096", "--recall-probe", "32")
    config = s.cache_config()
    assert (config.recall_budget, config.recall_block, config.recall_archive, config.recall_probe) == (64, 8, 4096, 32)
    assert (parse().cache_config().recall_queries, parse().cache_config().recall_ahead) == (32, False)
    assert CacheConfig().recall_queries == 32  # the library's default is the server's
    config = parse("--recall-queries", "64", "--recall-ahead").cache_config()
    assert (config.recall_queries, config.recall_ahead) == (64, True)
    assert parse("--recall-voters", "3").cache_config().recall_voters == 3
    # the question alone probes where a blank line sets it apart only when asked, in the server and the library
    assert parse("--recall-probe-break").cache_config().recall_probe_break and not parse().cache_config().recall_probe_break
    assert not CacheConfig().recall_probe_break
    assert parse().cache_config().recall_digest == "centre"
    assert parse("--recall-digest", "mean").cache_config().recall_digest == "mean"
    assert parse("--recall-digest", "minmax").cache_config().recall_digest == "minmax"
    # ranks for a reply's first 32 steps on the CPU; the text layout on a GPU unless told
    assert (parse().cache_config().recall_positions, parse().cache_config().recall_rank_steps) == ("rank", 32)
    assert parse().cache_config("cuda").recall_positions == "text"
    assert parse("--recall-positions", "rank").cache_config("cuda").recall_positions == "rank"
    assert parse("--recall-positions", "text").cache_config().recall_positions == "text"
    assert parse("--recall-rank-steps", "0").cache_config().recall_rank_steps == 0
    assert parse("--recall-voters", "0").cache_config().recall_voters == 0


def test_prompts_are_fed_in_half_budget_chunks_with_recall_and_256_without_unless_told():
    assert parse().cache_config().prefill_chunk == 128  # budget 256, recall on
    # capped decode-time choices: none on the CPU, one per step on a GPU, unless --recall-choices says
    assert parse().cache_config().recall_choices is None and parse().cache_config("cuda").recall_choices == 1
    assert parse("--recall-choices", "4").cache_config("cuda").recall_choices == 4
    assert parse("--recall-choices", "4").cache_config().recall_choices == 4
    assert "1 choice per step" in parse().cache_config("cuda").describe()
    assert parse("--kv-budget", "1024").cache_config().prefill_chunk == 512
    assert parse("--recall-budget", "0").cache_config().prefill_chunk == 256
    assert parse("--policy", "full").cache_config().prefill_chunk == 256
    assert parse("--prefill-chunk", "100").cache_config().prefill_chunk == 100
    assert parse("--kv-budget", "2").cache_config().prefill_chunk == 1


def test_api_key_is_repeatable_and_environment_variables_work(monkeypatch):
    assert parse("--api-key", "a", "--api-key", "b").api_key == ["a", "b"]
    monkeypatch.setenv("H2O_KV_BUDGET", "99")
    monkeypatch.setenv("H2O_API_KEY", "x, y")
    monkeypatch.setenv("H2O_POSITION_ROLLING", "false")
    s = parse()
    assert (s.kv_budget, s.api_key, s.position_rolling) == (99, ["x", "y"], False)
    assert parse("--kv-budget", "7").kv_budget == 7, "a flag wins over the environment"


@pytest.mark.parametrize("args", [["--port", "0"], ["--kv-budget", "1"], ["--heavy-ratio", "1.5"],
                                  ["--policy", "lru"], ["--device", "tpu"], ["--max-batch-size", "0"],
                                  ["--recall-budget", "-16"], ["--recall-block", "0"], ["--recall-probe", "0"]])
def test_out_of_bounds_values_are_refused(args):
    with pytest.raises((ValidationError, SystemExit)):
        parse(*args)


def test_threads_default_to_the_usable_cores():
    assert ServerSettings().torch_threads() >= 1 and ServerSettings(threads=3).torch_threads() == 3


def test_the_state_dir_defaults_to_the_xdg_data_home_and_an_empty_one_turns_persistence_off(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert parse().engine_config(None).state_dir == str(tmp_path / "h2o-chat")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse().state_dir == str(tmp_path / "home" / ".local" / "share" / "h2o-chat")
    off = parse("--state-dir", "", "--max-state-bytes", "1000").engine_config(None)
    assert off.state_dir is None and off.max_state_bytes == 1000
    monkeypatch.setenv("H2O_STATE_DIR", "/state")
    assert parse().engine_config(None).state_dir == "/state"
