"""H2O (Heavy-Hitter Oracle) KV cache with position rolling for transformers Llama-family models.

    from h2o_cache import CacheConfig, Generator, SamplingParams, load_model
    model, tokenizer = load_model()              # embedded SmolLM2-135M-Instruct
    gen = Generator(model, tokenizer, CacheConfig(policy="h2o", budget=256))
    [out] = gen.generate([gen.encode_chat([{"role": "user", "content": "Hi"}])], SamplingParams(max_new_tokens=64))
"""

from h2o_cache.cache import H2OCache, ModelSpec
from h2o_cache.config import CacheConfig
from h2o_cache.generation import Completion, Generator, consume
from h2o_cache.hf import UnsupportedModelError, forward, model_spec
from h2o_cache.loading import load_model
from h2o_cache.policies import POLICIES, Policy, get_policy, register_policy
from h2o_cache.sampling import Sample, Sampler, SamplingParams, sample
from h2o_cache.static import StaticDecoder
from h2o_cache.text import StreamDecoder

__all__ = [
    "CacheConfig", "Completion", "Generator", "H2OCache", "ModelSpec", "POLICIES", "Policy", "Sample",
    "Sampler", "SamplingParams", "StaticDecoder", "StreamDecoder", "UnsupportedModelError", "consume", "forward",
    "get_policy", "load_model", "model_spec", "register_policy", "sample",
]
