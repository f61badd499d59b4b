from h2o_cache import CacheConfig, Generator, StaticDecoder
from h2o_cache.bench.equivalence import first_difference, lockstep
from tests.conftest import tiny_llama


def test_lockstep_decodes_both_paths_to_the_same_tokens_on_the_cpu(byte_tokenizer):
    model = tiny_llama(init_std=0.3)
    config = CacheConfig(budget=16, prefill_chunk=8)
    gen = Generator(model, byte_tokenizer, config)
    result = lockstep(gen, StaticDecoder(model, config, max_rows=2), [list(range(3, 30)), [5, 6, 7]], steps=40)
    assert result.fast == result.eager and all(len(t) == 40 for t in result.fast)
    assert all(0 <= w < 1e-4 for w in result.worst)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2, 3], [1, 5, 3]) == 1
