"""`python -m h2o_cache.bench.step_profile` on a tiny batch: it runs and prints its two tables."""

from h2o_cache.bench import step_profile


def test_the_profile_prints_calls_per_step_and_per_row(capsys):
    step_profile.main(["--rows", "4", "--generated", "8", "--steps", "8", "--vocab", "64"])
    out = capsys.readouterr().out
    assert "| batch | Python calls per step | per row |" in out and "| 4 |" in out and "calls per step at batch 4" in out


def test_the_recall_profile_counts_calls_into_torch_on_the_gpus_path(capsys):
    step_profile.main(["--rows", "4", "--generated", "80", "--steps", "8", "--vocab", "64", "--recall", "kernel"])
    out = capsys.readouterr().out
    assert "torch calls per step" in out and "| 4 |" in out


def test_a_random_model_has_the_default_models_shapes():
    """`--model random` (`random_default_shapes`): the embedded GGUF's configuration, random weights."""
    import argparse

    from transformers import AutoConfig

    from h2o_cache.bench.common import IdsOnly, load
    from h2o_cache.loading import default_model_path

    model, tokenizer = load(argparse.Namespace(model="random", device="cpu", dtype="bfloat16", threads=1))
    gguf = default_model_path()
    real = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(model.config, name) == getattr(real, name), name
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.bfloat16" and isinstance(tokenizer, IdsOnly)
