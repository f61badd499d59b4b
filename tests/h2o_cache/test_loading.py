import pytest
import torch

from h2o_cache import load_model
from h2o_cache.loading import default_model_path, model_name, resolve_device, resolve_dtype


@pytest.mark.model
def test_default_model_is_the_embedded_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert model_name(None) == "SmolLM2-135M-Instruct"
    assert model_name(str(path)) == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.model
def test_loads_a_hugging_face_directory_with_chosen_dtype(tmp_path, default_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = default_model
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, loaded_tokenizer = load_model(str(tmp_path), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 1
    assert loaded_tokenizer.encode("hello") == tokenizer.encode("hello")


def test_bad_paths_and_options_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf model"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", torch.device("cpu"))
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_the_collector_is_paused_while_a_model_loads_and_restored_after(tmp_path, monkeypatch):
    import gc

    from h2o_cache import loading

    seen = []

    def fake_load(model, device, dtype):
        seen.append(gc.isenabled())
        if model == "fails":
            raise OSError("unreadable")
        return "model", "tokenizer"

    monkeypatch.setattr(loading, "_load", fake_load)
    assert gc.isenabled()
    assert load_model("anything") == ("model", "tokenizer")
    with pytest.raises(OSError, match="unreadable"):
        load_model("fails")
    assert seen == [False, False] and gc.isenabled()  # back on after a load, and after a failed one
    gc.disable()
    try:
        load_model("anything")
        assert not gc.isenabled()  # a caller's choice to keep it off stands
    finally:
        gc.enable()
