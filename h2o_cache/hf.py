"""Everything that touches transformers internals (tested on transformers 5.23).

The cache plugs into a stock Llama-family model through two public hooks:
- `past_key_values`: `PastKeyValues`, transformers' cache interface over an `H2OCache` (which knows
  nothing of transformers); the model calls its `update` per layer with RoPE-rotated keys;
- `AttentionInterface`: attention function "h2o", enabled only for our own forward passes, which
  hands queries to `H2OCache.attend` (fp32 softmax + per-KV-head score accumulation). The model's
  mask builder skips unregistered implementations, so no L x L mask is ever built; the cache masks.

`decoder_weights` reads a Llama-architecture model's tensors for the fast path (`h2o_cache.decode`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from h2o_cache.cache import H2OCache, ModelSpec
from h2o_cache.decode import DecoderWeights, LayerWeights
from h2o_cache.quantized import QuantizedMatrix
from h2o_cache.rope import RopeTable

ATTENTION_NAME = "h2o"


def _h2o_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, h2o_cache=None, **kwargs):
    if h2o_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return h2o_cache.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, _h2o_attention)


class _Layer(CacheLayerMixin):
    """One decoder layer's view of an `H2OCache` (transformers' per-layer interface)."""

    is_compileable = False

    def __init__(self, cache: H2OCache, index: int) -> None:
        super().__init__()
        self._cache = cache
        self._index = index

    @property
    def keys(self):  # as stored: before RoPE when rolling
        return None if self._cache._keys is None else self._cache._keys[self._index]

    @property
    def values(self):
        return None if self._cache._values is None else self._cache._values[self._index]

    @keys.setter
    def keys(self, value):  # CacheLayerMixin.__init__ assigns None; storage belongs to the cache
        pass

    @values.setter
    def values(self, value):
        pass

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("the H2OCache allocates its buffers")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("call PastKeyValues.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class PastKeyValues(Cache):
    """transformers' `Cache` interface over an `H2OCache`, for one forward pass of `forward`."""

    def __init__(self, cache: H2OCache):
        self.cache = cache
        super().__init__(layers=[_Layer(cache, i) for i in range(cache.spec.num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.cache.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length()


class UnsupportedModelError(ValueError):
    """The model is not a decoder-only transformer with rotary position embeddings."""


def _frequencies(rotary) -> torch.Tensor | None:
    """The rotary embedding's D/2 frequencies, if it keeps them as `inv_freq` (transformers' RoPE
    modules do) and they do not change with the position."""
    inv_freq = getattr(rotary, "inv_freq", None)
    dynamic = "dynamic" in str(getattr(rotary, "rope_type", ""))
    return None if inv_freq is None or dynamic else inv_freq.float()


def model_spec(model: PreTrainedModel) -> ModelSpec:
    """Check that `model` is a RoPE decoder the cache can drive and describe it for `H2OCache`."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; h2o_cache needs a decoder-only model")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    layers = getattr(decoder, "layers", None)
    if rotary is None or layers is None or model.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"{name} is not a decoder with rotary position embeddings (Llama-family) and an LM head"
        )
    if getattr(config, "sliding_window", None) or getattr(config, "layer_types", None) and any(
        t != "full_attention" for t in config.layer_types
    ):
        raise UnsupportedModelError(f"{name} uses sliding-window or hybrid attention layers, which h2o_cache does not drive")
    param = next(model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dummy = torch.empty(0, device=param.device, dtype=torch.float32)
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        device=param.device,
        dtype=param.dtype,
        rope=RopeTable(lambda positions: rotary(dummy, positions), param.device, _frequencies(rotary),
                       float(getattr(rotary, "attention_scaling", 1.0))),
        num_heads=config.num_attention_heads,
        scaling=float(getattr(layers[0].self_attn, "scaling", head_dim ** -0.5)),
    )


@contextmanager
def _h2o_attention_enabled(model: PreTrainedModel):
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        model.config._attn_implementation = previous


@torch.no_grad()  # not inference_mode: cache buffers must stay editable between passes
def forward(
    model: PreTrainedModel,
    cache: H2OCache,
    input_ids: torch.Tensor,
    n_new: list[int],
    all_logits: bool = False,
    ahead: list[bool] | None = None,
) -> torch.Tensor:
    """One pass feeding input_ids [B, C] (row b: its first n_new[b] tokens are real) through the cache.
    ahead[b]: row b's tokens are of a prompt's body, not its tail (`H2OCache.begin`).

    Returns fp32 logits of each row's last real token [B, V], or of every position [B, C, V].
    """
    positions = cache.begin(n_new, ahead)
    try:
        with _h2o_attention_enabled(model):
            hidden = model.get_decoder()(
                input_ids=input_ids, position_ids=positions, past_key_values=PastKeyValues(cache),
                use_cache=True, h2o_cache=cache,
            ).last_hidden_state
    except BaseException:
        cache.abort()
        raise
    cache.end()
    if not all_logits:
        last = torch.tensor(n_new, device=hidden.device) - 1
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return model.get_output_embeddings()(hidden).float()


_LAYER_PARTS = {
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "mlp": {"gate_proj", "up_proj", "down_proj"},
}


def decoder_weights(model: PreTrainedModel, packed: dict[int, QuantizedMatrix] | None = None) -> DecoderWeights:
    """The weights of a plain Llama-architecture model for `decode.decode_step`, q/k/v and gate/up fused.

    packed: quantized forms of some of the model's matrices, keyed by `id()` of the parameter
    (`quantized.gguf_matrices`); those replace the dense ones, fused parts only when all are packed alike.

    Raises UnsupportedModelError for a layer with anything Llama's lacks (q/k norms, extra
    projections, non-RMS norms), so a caller can fall back to the transformers path.
    """
    spec = model_spec(model)
    decoder = model.get_decoder()
    config = model.config
    layers = []
    for layer in decoder.layers:
        for part, names in _LAYER_PARTS.items():
            children = {n for n, _ in getattr(layer, part).named_children()} - {"act_fn", "rotary_emb"}
            if children != names:
                raise UnsupportedModelError(f"{type(model).__name__}.{part} has {sorted(children)}, not Llama's {sorted(names)}")
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(not type(n).__name__.endswith("RMSNorm") for n in norms) or len(list(layer.children())) != 4:
            raise UnsupportedModelError(f"{type(model).__name__} decoder layers are not Llama's (norm, attention, norm, MLP)")
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=_fused(packed, attn.q_proj, attn.k_proj, attn.v_proj),
            qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
            o=_weight(packed, attn.o_proj.weight), o_bias=attn.o_proj.bias,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=_fused(packed, mlp.gate_proj, mlp.up_proj),
            gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
            down=_weight(packed, mlp.down_proj.weight), down_bias=mlp.down_proj.bias,
        ))
    return DecoderWeights(
        embed=decoder.embed_tokens.weight,
        layers=layers,
        norm=decoder.norm.weight,
        lm_head=_weight(packed, model.get_output_embeddings().weight),
        num_heads=config.num_attention_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        scaling=decoder.layers[0].self_attn.scaling,
        eps=decoder.norm.variance_epsilon,
        act=_plain_function(decoder.layers[0].mlp.act_fn),
    )


def _plain_function(act):
    """transformers' SiLU module as the functional op it wraps: one dispatch fewer per layer."""
    if type(act).__name__ in ("SiLU", "SiLUActivation"):
        return torch.nn.functional.silu
    return act


def _weight(packed: dict[int, QuantizedMatrix] | None, weight: torch.Tensor) -> torch.Tensor | QuantizedMatrix:
    return (packed or {}).get(id(weight), weight.detach())


def _fused(packed: dict[int, QuantizedMatrix] | None, *linears) -> torch.Tensor | QuantizedMatrix:
    """Weights of linears applied to the same input, stacked: [sum of out, in].

    The model's own weights become views of the stacked matrix, so the weights are held once (an 8B
    model in bf16 would otherwise hold ~9 GB of q/k/v and gate/up twice); a second call finds them
    stacked already and returns the same matrix.
    """
    parts = [(packed or {}).get(id(linear.weight)) for linear in linears]
    if all(parts) and (fused := QuantizedMatrix.cat(parts)) is not None:
        return fused
    weights = [linear.weight.detach() for linear in linears]
    first = weights[0]
    rows = sum(w.shape[0] for w in weights)
    if _stacked(weights):
        return first.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())
    fused = torch.cat(weights)
    start = 0
    for linear, weight in zip(linears, weights):
        linear.weight.data = fused[start:start + weight.shape[0]]
        start += weight.shape[0]
    return fused


def _stacked(weights: list[torch.Tensor]) -> bool:
    """Whether the weights are consecutive rows of one contiguous matrix."""
    storage = weights[0].untyped_storage().data_ptr()
    offset = weights[0].storage_offset()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset:
            return False
        offset += w.numel()
    return storage != 0


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else linear.weight.new_zeros(linear.out_features)
                      for b, linear in zip(biases, linears)])
