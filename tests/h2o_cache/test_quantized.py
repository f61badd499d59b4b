"""GGUF-block products and the native step (`quantized.py`, `kernels/cpu_decode.cpp`), and the fast path using them."""

import shutil

import gguf
import numpy as np
import pytest
import torch

from h2o_cache import CacheConfig, Generator, H2OCache, StaticDecoder
from h2o_cache.decode import DecoderWeights
from h2o_cache.prefill_products import apply_prefill_dtype
from h2o_cache.quantized import EXACT, INT8_AVX2, INT8_VNNI, QuantizedMatrix, gguf_matrices, kernel
from tests.conftest import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the kernel")
KINDS = ["Q4_1", "Q8_0"]


def quantized(weight: torch.Tensor, kind: str) -> QuantizedMatrix:
    blocks = gguf.quantize(weight.numpy(), gguf.GGMLQuantizationType[kind])
    return QuantizedMatrix(kind, torch.from_numpy(blocks), weight.shape[1])


@pytest.fixture(params=KINDS)
def matrix(request) -> QuantizedMatrix:
    assert kernel() is not None, "a compiler is here, so the kernel must build"
    return quantized(torch.randn(40, 96, generator=torch.Generator().manual_seed(0)), request.param)


def test_the_kernel_uses_gguf_s_dequantized_weights_bit_for_bit(matrix):
    identity = torch.eye(matrix.in_features)  # one nonzero product per output: W's columns, unrounded
    assert torch.equal(matrix.matmul(identity).T, matrix.dequantize())


def test_products_match_the_dense_weights_and_no_row_depends_on_its_batch(matrix):
    x = torch.randn(9, matrix.in_features, generator=torch.Generator().manual_seed(1))
    out = matrix.matmul(x)
    torch.testing.assert_close(out, x @ matrix.dequantize().T, rtol=1e-5, atol=1e-5)
    for batch in range(1, 9):
        assert torch.equal(matrix.matmul(x[:batch]), out[:batch])
    for row in range(9):
        assert torch.equal(matrix.matmul(x[row:row + 1])[0], out[row])
    residual = torch.randn(9, matrix.out_features)
    assert torch.equal(matrix.matmul(x, residual), residual + out)
    assert torch.equal(matrix.matmul(x.T.contiguous().T), out)  # a column-major x is read as its values


def integer_paths() -> list[str]:
    return [INT8_AVX2, INT8_VNNI] if kernel() is not None and kernel().h2o_has_vnni() else [INT8_AVX2]


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the integer path sees it: per 32-block, d = max|x| / 127 and x ~ d round(x / d)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def test_integer_products_are_the_exact_product_of_the_int8_activations(matrix):
    x = torch.randn(9, matrix.in_features, generator=torch.Generator().manual_seed(1))
    x[2, :32] = 0  # an all-zero block has d = 0
    w = matrix.dequantize().double()
    reference = q8_blocks(x).double() @ w.T  # only the order of fp32 sums differs
    exact = x.double() @ w.T
    # activation rounding moves each product by at most |w| d / 2
    bound = (w.abs() @ (x.reshape(9, -1, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1).T.double()).T
    results = []
    for path in integer_paths():
        out = matrix.matmul(x, activations=path)
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
        assert ((out.double() - exact).abs() <= bound + 1e-4).all()
        assert (out.double() - exact).abs().max() > 1e-4  # the path does quantize
        for batch in range(1, 9):
            assert torch.equal(matrix.matmul(x[:batch], activations=path), out[:batch])
        residual = torch.randn(9, matrix.out_features)
        assert torch.equal(matrix.matmul(x, residual, activations=path), residual + out)
        results.append(out)
    assert all(torch.equal(r, results[0]) for r in results)  # VNNI sums the same integers as AVX2


@pytest.mark.parametrize("kind", KINDS)
def test_rows_packed_by_eight_sum_the_same_integers_as_row_by_row(kind):
    """The integer path multiplies matrices of whole groups of 8 rows in the packed layout
    (`pack_rows`), others row by row: per block the same exact integer sums, so the two agree to the
    order of the fp32 sums over blocks, and each keeps every row independent of its batch."""
    weight = torch.randn(48, 160, generator=torch.Generator().manual_seed(2))
    packed = quantized(weight, kind)
    row_by_row = QuantizedMatrix(kind, torch.cat([packed.blocks, packed.blocks[:4]]), packed.in_features)  # 52 rows
    assert packed.product_blocks(INT8_AVX2)[0] == row_by_row.product_blocks(INT8_AVX2)[0] + 2
    assert packed.product_blocks(EXACT)[1] is packed.blocks
    x = torch.randn(11, packed.in_features, generator=torch.Generator().manual_seed(3))
    for path in integer_paths():
        out = packed.matmul(x, activations=path)
        torch.testing.assert_close(out, row_by_row.matmul(x, activations=path)[:, :48], rtol=1e-5, atol=1e-4)
        for batch in range(1, 11):  # tiles of 8, 4 and the rest
            assert torch.equal(packed.matmul(x[batch - 1:batch + batch // 2], activations=path), out[batch - 1:batch + batch // 2])


def test_packed_blocks_are_refused_on_the_exact_path():
    weight = quantized(torch.randn(8, 32, generator=torch.Generator().manual_seed(4)), "Q4_1")
    x = torch.randn(1, 32)
    out = torch.empty(1, 8)
    status = kernel().h2o_qmatmul(2, weight.packed.data_ptr(), x.data_ptr(), out.data_ptr(), 1, 8, 32, 32, 8, 0, 1, 0)
    assert status == 7


def test_widths_that_are_not_whole_blocks_are_refused(matrix):
    odd = QuantizedMatrix(matrix.kind, matrix.blocks, matrix.in_features - 1)
    with pytest.raises(ValueError, match="refused"):
        odd.matmul(torch.randn(1, odd.in_features))


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q and k rows in the order llama.cpp's converter stores them (the inverse of transformers' reading)."""
    n = weight.shape[0]
    return weight.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_llama(path, model) -> None:
    """Quantize `model` in place to Q4_1 layers and a Q8_0 head, and write those blocks as a GGUF file
    with llama.cpp's tensor names and q/k row order (only what `gguf_matrices` reads)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    config = model.config
    tensors = {"output.weight": (model.lm_head.weight, "Q8_0", None)}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, linear, heads in (("attn_q", attn.q_proj, config.num_attention_heads),
                                    ("attn_k", attn.k_proj, config.num_key_value_heads),
                                    ("attn_v", attn.v_proj, None), ("attn_output", attn.o_proj, None),
                                    ("ffn_gate", mlp.gate_proj, None), ("ffn_up", mlp.up_proj, None),
                                    ("ffn_down", mlp.down_proj, None)):
            tensors[f"blk.{i}.{name}.weight"] = (linear.weight, "Q4_1", heads)
    with torch.no_grad():
        for name, (weight, kind, heads) in tensors.items():
            matrix = quantized(weight.detach(), kind)
            weight.copy_(matrix.dequantize())
            blocks = matrix.blocks.numpy()
            if heads is not None:
                blocks = llama_cpp_rows(blocks, heads)
            writer.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    model = tiny_llama(init_std=0.3)  # peaked logits: no near-ties for greedy decoding to flip on
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    gguf_llama(path, model)
    model.gguf_path = path
    return model


def matrices(weights: DecoderWeights) -> list:
    return [m for lw in weights.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [weights.lm_head]


def test_every_matrix_of_the_file_is_found_in_transformers_row_order(gguf_model):
    packed = gguf_matrices(gguf_model.gguf_path, gguf_model)
    linears = [m for layer in gguf_model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert {id(m.weight) for m in linears} | {id(gguf_model.lm_head.weight)} == set(packed)
    decoder = StaticDecoder(gguf_model, CacheConfig(policy="h2o", budget=16), max_rows=4)
    assert all(isinstance(m, QuantizedMatrix) for m in matrices(decoder.quantized_weights))


def test_a_matrix_that_differs_from_the_loaded_weights_stays_dense(gguf_model):
    k_proj = gguf_model.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k_proj[0, 0] += 1e-3
    try:
        packed = gguf_matrices(gguf_model.gguf_path, gguf_model)
        decoder = StaticDecoder(gguf_model, CacheConfig(policy="h2o", budget=16), max_rows=4)
    finally:
        with torch.no_grad():
            k_proj[0, 0] -= 1e-3
    assert id(k_proj) not in packed and len(packed) == 7 * 2 + 1 - 1
    layers = decoder.quantized_weights.layers
    assert isinstance(layers[1].qkv, torch.Tensor) and isinstance(layers[0].qkv, QuantizedMatrix)
    assert decoder.native is None  # a dense matrix: the step stays in torch ops


@pytest.mark.parametrize("recall", [False, True])
@pytest.mark.parametrize("hidden, heads, kv_heads", [(64, 1, 1), (64, 2, 1), (96, 3, 1), (64, 4, 1)])
def test_the_native_step_attends_as_the_torch_ops_for_every_query_group(tmp_path, hidden, heads, kv_heads, recall):
    """The native step's attention takes a KV head's query group up to three queries at a time, each
    key and value read once for them: groups of 1, 2, 3 and 4 (3 + 1) queries, head_dim 64, 32 and
    16, rows whose slot counts are not multiples of 4, with recall a window read from its fp16 copy;
    the logits are the torch ops' step's (fp32, in another order of sums)."""
    model = tiny_llama(init_std=0.3, hidden=hidden, heads=heads, kv_heads=kv_heads)
    model.gguf_path = tmp_path / "tiny.gguf"
    gguf_llama(model.gguf_path, model)
    settings = dict(policy="h2o", budget=16, evict_slack=3, prefill_chunk=8)
    if recall:
        settings.update(budget=32, evict_slack=4, recall_budget=16, recall_block=4, recall_probe=6, recall_interval=3)
    config = CacheConfig(**settings)
    gen = Generator(model, ByteTokenizer(), config)
    native = StaticDecoder(model, config, max_rows=4, exact=True)
    ops = StaticDecoder(model, config, max_rows=4, native=False)
    assert native.native is not None and ops.native is None
    assert (native.native.window is not None) == recall
    for i, n in enumerate((70, 81, 95) if recall else (5, 11, 18)):
        row = gen.new_cache(1)
        logits = gen.prefill(row, [[3 + (7 * j + i) % 120 for j in range(n)]], recall=recall)
        row.pending = [[int(logits[0].argmax())]]
        for decoder in (native, ops):
            decoder.cache.extend(row)
    slots = set()
    for _ in range(12):
        slots.update(n + 1 for n in native.cache.lengths)  # what this step attends over
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        for decoder in (native, ops):
            decoder.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert native.cache.lengths == ops.cache.lengths and {n % 4 for n in slots} == {0, 1, 2, 3}
    if recall:
        assert all(r == 16 for r in native.cache.recalled)


def test_the_quantized_fast_path_decodes_the_transformers_path_s_tokens(gguf_model):
    """Rows join and leave, evict at different steps and run in padded buckets, as in the engine: 256
    steps of the exact native step against the transformers path."""
    config = CacheConfig(policy="h2o", budget=16, evict_slack=3, prefill_chunk=8)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    decoder = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    assert decoder.quantized_weights is not None and decoder.native is not None
    eager = gen.new_cache(0)
    prompts = [list(range(3 + i, 20 + 5 * i)) for i in range(5)]
    tokens: dict[int, tuple[list[int], list[int]]] = {}
    running: list[int] = []  # prompt index of each row, in the caches' row order
    for step in range(256):
        if step % 15 == 0 and len(tokens) < len(prompts) and len(running) < 4:
            row = gen.new_cache(1)
            gen.prefill(row, [prompts[len(tokens)]])
            row.pending = [[7 + len(tokens)]]
            eager.extend(row)
            decoder.cache.extend(row)
            running.append(len(tokens))
            tokens[len(tokens)] = ([], [])
        if step % 25 == 24 and len(running) > 1:  # the oldest row leaves
            eager.pop(0)
            decoder.cache.pop(0)
            running.pop(0)
        by_eager = gen.step(eager, eager.pending).argmax(dim=-1).tolist()
        by_fast = decoder.step().argmax(dim=-1).tolist()
        for name, e, f in zip(running, by_eager, by_fast, strict=True):
            tokens[name][0].append(e)
            tokens[name][1].append(f)
        eager.pending = [[t] for t in by_eager]
        decoder.cache.pending = [[t] for t in by_fast]
    assert max(eager.seen) > 5 * config.budget and sum(len(t[0]) for t in tokens.values()) > 300
    assert len(tokens) == len(prompts)
    for by_eager, by_fast in tokens.values():
        assert by_fast == by_eager


def rows_near_budget(gen: Generator, config: CacheConfig, count: int) -> H2OCache:
    """`count` rows 0..count-1 tokens short of the budget (so they evict at different steps), one token pending."""
    batch = gen.new_cache(0)
    for i in range(count):
        row = gen.new_cache(1)
        gen.prefill(row, [[3 + (5 * i + 7 * t) % 120 for t in range(config.budget - i)]])
        row.pending = [[10 + i]]
        batch.extend(row)
    return batch


def test_the_native_step_computes_decode_step_s_logits_and_cache_writes(gguf_model):
    config = CacheConfig(policy="h2o", budget=16, evict_slack=3, prefill_chunk=8)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    native = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    ops = StaticDecoder(gguf_model, config, max_rows=4, native=False)
    assert native.native is not None and ops.native is None
    rows = rows_near_budget(gen, config, 3)  # a bucket of 4 with a padding row
    native.cache.extend(rows)
    ops.cache.extend(rows)
    for _ in range(12):  # every row crosses the budget and evicts
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        native.cache.pending = ops.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert max(native.cache.seen) > config.budget + config.slack
    a, b = native.cache.buffers(), ops.cache.buffers()
    for name in ("keys", "values", "rotated", "scores"):
        torch.testing.assert_close(getattr(a, name)[:, :3], getattr(b, name)[:, :3], rtol=1e-5, atol=1e-5)
    assert torch.equal(a.origins[:, :3], b.origins[:, :3])
    assert native.cache.lengths == ops.cache.lengths


@pytest.mark.parametrize("exact", [True, False])
def test_a_row_s_native_step_does_not_depend_on_its_batch(gguf_model, exact):
    config = CacheConfig(policy="h2o", budget=16, evict_slack=3, prefill_chunk=8)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    rows = rows_near_budget(gen, config, 5)
    alone, shared = (StaticDecoder(gguf_model, config, max_rows=8, exact=exact) for _ in range(2))
    alone.cache.extend(rows)
    for _ in range(4):
        alone.cache.pop(1)  # row 0 only: bucket 1
    shared.cache.extend(rows)  # row 0 with four others: bucket 8
    for _ in range(10):
        by_alone, by_shared = alone.step(), shared.step()
        assert torch.equal(by_alone[0], by_shared[0])
        tokens = by_shared.argmax(dim=-1).tolist()
        alone.cache.pending, shared.cache.pending = [[tokens[0]]], [[t] for t in tokens]
    a, b = alone.cache.buffers(), shared.cache.buffers()
    assert torch.equal(a.scores[:, 0], b.scores[:, 0]) and torch.equal(a.rotated[:, 0], b.rotated[:, 0])


def test_int8_prefill_takes_every_block_matrix_through_the_integer_products(tmp_path):
    """`--prefill-dtype int8`: a prompt chunk's products (more than one token per row) are the decode
    step's integer ones, within the activations' rounding of the fp32 path; single tokens, and every
    input once the switch is off, take the fp32 products bit for bit."""
    model, reference = tiny_llama(seed=7, init_std=0.3), tiny_llama(seed=7, init_std=0.3)
    gguf_llama(tmp_path / "m.gguf", model)
    reference.load_state_dict(model.state_dict())
    model.gguf_path = tmp_path / "m.gguf"
    switch = apply_prefill_dtype(model, "int8")
    assert switch is not None and len(switch.layers) == 7 * len(model.get_decoder().layers)
    assert apply_prefill_dtype(tiny_llama(seed=7), "int8") is None  # no GGUF file: nothing to take
    layer, dense = model.get_decoder().layers[1].mlp.down_proj, reference.get_decoder().layers[1].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(8))
    out = layer(x)
    integer = layer.int8_matrix.matmul(x.reshape(10, -1), activations=INT8_AVX2).view(2, 5, -1)
    assert torch.equal(out, integer)  # VNNI and AVX2 sum the same integers
    assert not torch.equal(out, dense(x))
    torch.testing.assert_close(out, dense(x), rtol=0.05, atol=0.05)
    assert torch.equal(layer(x[:, :1]), dense(x[:, :1]))  # one token per row: the fp32 product
    switch.enabled = False
    assert torch.equal(layer(x), dense(x))


def test_without_a_compiler_the_fast_path_keeps_dense_weights(gguf_model, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("H2O_KERNEL_CACHE", str(tmp_path / "kernels"))  # nothing built there yet
    kernel.cache_clear()
    try:
        assert kernel() is None
        decoder = StaticDecoder(gguf_model, CacheConfig(policy="h2o", budget=16), max_rows=2)
        assert decoder.quantized_weights is None and decoder.native is None
        with pytest.raises(ValueError, match="kernel"):
            StaticDecoder(gguf_model, CacheConfig(policy="h2o", budget=16), max_rows=2, quantized=True)
    finally:
        kernel.cache_clear()


@pytest.mark.model
def test_the_default_model_decodes_on_its_own_q4_1_and_q8_0_blocks_with_the_eager_tokens(default_model):
    model, tokenizer = default_model
    config = CacheConfig(policy="h2o", budget=64, prefill_chunk=64)
    gen = Generator(model, tokenizer, config)
    decoder = StaticDecoder(model, config, max_rows=2, exact=True)
    assert all(isinstance(m, QuantizedMatrix) for m in matrices(decoder.quantized_weights))
    assert {m.kind for m in matrices(decoder.quantized_weights)} == {"Q4_1", "Q8_0"}
    eager = gen.new_cache(0)
    for question in ("Name three primary colors.", "Write a haiku about the sea."):
        row = gen.new_cache(1)
        prompt = gen.encode_chat([{"role": "user", "content": question}])
        gen.prefill(row, [prompt[:-1]])
        row.pending = [prompt[-1:]]
        eager.extend(row)
        decoder.cache.extend(row)
    by_eager, by_fast = [], []
    for _ in range(80):  # prompts of ~30 tokens: both rows pass the budget of 64 and evict
        by_eager.append(gen.step(eager, eager.pending).argmax(dim=-1).tolist())
        by_fast.append(decoder.step().argmax(dim=-1).tolist())
        eager.pending = [[t] for t in by_eager[-1]]
        decoder.cache.pending = [[t] for t in by_fast[-1]]
    assert max(eager.seen) > config.budget + 20
    assert by_fast == by_eager
