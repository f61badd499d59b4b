"""The same guarantees on a GPU, in the dtypes used there (skipped where CUDA is absent, as in CI)."""

import asyncio

import pytest
import torch
from transformers import DynamicCache

from h2o_cache import CacheConfig, Generator, SamplingParams
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference_greedy(model, prompt, n):
    cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt], device="cuda"), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(ids, past_key_values=cache).logits[0, -1].argmax()))
            ids = torch.tensor([out[-1:]], device="cuda")
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_model(request):
    return tiny_llama().to("cuda", request.param)


@pytest.mark.parametrize("policy", ["h2o", "streaming", "full"])
def test_matches_transformers_on_cuda_when_budget_covers_everything(cuda_model, byte_tokenizer, policy):
    gen = Generator(cuda_model, byte_tokenizer, CacheConfig(policy=policy, budget=128, prefill_chunk=16))
    prompt = list(range(3, 40))
    [out] = gen.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert out.token_ids == reference_greedy(cuda_model, prompt, 20)


def test_batched_equals_single_with_eviction_on_cuda(cuda_model, byte_tokenizer):
    gen = Generator(cuda_model, byte_tokenizer, CacheConfig(policy="h2o", budget=12, prefill_chunk=8))
    prompts = [list(range(3, 30)), [9, 8, 7], list(range(50, 70))]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=3)
    cache = gen.new_cache(3)
    batched = gen.generate(prompts, params, cache)
    assert cache._scores.dtype == torch.float32 and cache._keys.dtype == cuda_model.dtype
    assert cache._keys.device.type == "cuda" and max(cache.lengths) <= 12
    for prompt, out in zip(prompts, batched):
        [alone] = gen.generate([prompt], params)
        assert out.token_ids == alone.token_ids


def test_engine_serves_concurrent_requests_on_cuda(cuda_model, byte_tokenizer):
    from server.engine import ChatRequest, Engine, EngineConfig, Finish
    from tests.engine.conftest import render

    async def run():
        engine = Engine(cuda_model, byte_tokenizer, CacheConfig(policy="h2o", budget=32, prefill_chunk=16),
                        EngineConfig(), render=render)
        engine.start()
        try:
            params = SamplingParams(max_new_tokens=40, ignore_eos=True)
            handles = [await engine.submit(ChatRequest([{"role": "user", "content": f"q{i}" * 20}], params))
                       for i in range(4)]
            finishes = []
            for handle in handles:
                async for item in handle:
                    if isinstance(item, Finish):
                        finishes.append(item)
            return finishes
        finally:
            engine.stop()

    finishes = asyncio.run(run())
    assert [f.usage.completion_tokens for f in finishes] == [40] * 4
    assert all(f.usage.kv_resident_tokens <= 32 for f in finishes)


def test_cuda_graph_decode_matches_the_transformers_path(cuda_model, byte_tokenizer):
    """fp32: the same greedy tokens over 200 evicting steps; bf16: logits within 3% of the largest
    logit (bf16 rounds at 0.4%; the tiny random model's near-uniform logits make bf16 argmax ties,
    so greedy text is compared on the real model by `python -m h2o_cache.bench.equivalence`)."""
    from h2o_cache import StaticDecoder
    from h2o_cache.bench.equivalence import lockstep

    config = CacheConfig(policy="h2o", budget=24, prefill_chunk=8)
    gen = Generator(cuda_model, byte_tokenizer, config)
    decoder = StaticDecoder(cuda_model, config, max_rows=4)
    assert decoder.cuda_graphs
    rows = [list(range(3, 40)), [9, 8, 7], list(range(50, 75))]
    result = lockstep(gen, decoder, rows, 200 if cuda_model.dtype == torch.float32 else 30)
    if cuda_model.dtype == torch.float32:
        assert result.fast == result.eager and max(result.worst) < 1e-4
    else:
        assert max(result.worst) < 0.03
    assert max(decoder.cache.lengths) <= 24 < min(decoder.cache.seen)


def test_recall_on_cuda_archives_in_pinned_memory_and_recalls_what_the_cpu_does(byte_tokenizer):
    """Archives fill by one asynchronous copy per eviction through pinned memory into ordinary host
    memory; what they hold, the blocks recalled and the cache they leave are those of the same model on
    the CPU (fp32: the choice of blocks is not near a tie)."""
    config = CacheConfig(policy="h2o", budget=32, evict_slack=4, prefill_chunk=8, recall_budget=16, recall_block=4,
                         recall_probe=6)
    turns = [list(range(3, 90)), list(range(20, 27)), list(range(60, 75))]
    caches = {}
    for device in ("cpu", "cuda"):
        gen = Generator(tiny_llama(init_std=0.3).to(device), byte_tokenizer, config)
        cache = gen.new_cache(1)
        for turn in turns:
            gen.prefill(cache, [turn], recall=True)
        caches[device] = cache
    gpu, cpu = caches["cuda"], caches["cpu"]
    assert not gpu.archives[0]._data["keys"].is_pinned() and gpu.recalled == cpu.recalled == [16]
    assert len(gpu.archives[0]) == len(cpu.archives[0])
    assert torch.equal(gpu.archives[0].state()["origins"], cpu.archives[0].state()["origins"])
    n = cpu.lengths[0]
    assert torch.equal(gpu.buffers().origins[:, 0, :, :n].cpu(), cpu.buffers().origins[:, 0, :, :n])


def decode_choices(device: str, tokenizer, kernel: bool, steps: int = 12, voters: int = 0, overlap: bool = False,
                   positions: str = "text", rank_steps: int | None = 32):
    """(windows, logits) of two rows decoded on the fast path with recall on `device`: a choice due at
    every step, at most one row choosing per step (as the server sets on CUDA), fed fixed tokens; kernel:
    the C++ kernel makes the choices (on CUDA it chooses and the torch ops fill the window); voters: after a
    burst of 2, the choices pool the votes of that many of a 4-layer model's layers; overlap: the choices
    after a reply's first run beside the step (`recall_overlap`, forced on the CPU too); positions:
    `recall_positions` (with "rank" the CUDA step sorts each head's origins itself); rank_steps:
    `recall_rank_steps` (the decode steps of a reply read at ranks, then the text layout)."""
    from h2o_cache import StaticDecoder

    config = CacheConfig(policy="h2o", budget=32, evict_slack=4, prefill_chunk=8, recall_budget=16, recall_block=4,
                         recall_probe=6, recall_interval=1, recall_choices=1, recall_kernel=kernel,
                         recall_voters=voters, recall_burst=2 if voters else 16, recall_overlap=overlap,
                         recall_positions=positions, recall_rank_steps=rank_steps)
    model = tiny_llama(init_std=0.3, layers=4 if voters else 2).to(device)
    gen = Generator(model, tokenizer, config)
    decoder = StaticDecoder(model, config, max_rows=2)
    for seed in (0, 1):
        row = gen.new_cache(1)
        gen.prefill(row, [list(range(3 + seed, 90))], recall=True)
        gen.prefill(row, [list(range(20 + seed, 27))], recall=True)
        row.pending = [[40 + seed]]
        decoder.cache.extend(row)
    logits = []
    for step in range(steps):
        logits.append(decoder.step().float().cpu())
        decoder.cache.pending = [[(7 * step + row) % 100 + 3] for row in range(2)]
    return [w[1].clone() for w in decoder.cache.windows], torch.stack(logits), decoder.cache.recall_count


@pytest.mark.parametrize("overlap", [False, True], ids=["before-the-step", "beside-the-step"])
@pytest.mark.parametrize("voters", [0, 1], ids=["all-layers", "1-voting-layer"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_decode_time_choices_on_cuda_match_the_cpu(byte_tokenizer, kernel, voters, overlap):
    """The fast step's decode-time recall choices on CUDA (fp32; the archive in host memory, ranked
    there by the torch ops or the C++ kernel, one row per step) hold the same windows, recall as many
    tokens and give the same logits as the same model's on the CPU (the same ranking there)."""
    cpu = decode_choices("cpu", byte_tokenizer, kernel, voters=voters, overlap=overlap)
    gpu = decode_choices("cuda", byte_tokenizer, kernel, voters=voters, overlap=overlap)
    assert all(torch.equal(a, b) for a, b in zip(cpu[0], gpu[0]))
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-3, atol=1e-3)
    assert gpu[2] == cpu[2] and min(cpu[2]) > 0


@pytest.mark.parametrize("rank_steps", [32, 4], ids=["ranks-throughout", "ranks-then-text"])
def test_decode_time_choices_on_cuda_match_the_cpu_with_every_held_key_at_its_rank(byte_tokenizer, rank_steps):
    """`recall_positions` "rank": the CUDA graph's step rotates the keys to their ranks itself
    (`decode.ranked_keys`) and reads what the CPU's step reads; with 4 rank steps of 12 the rows'
    flags turn to the text layout inside the captured step, as on the CPU."""
    cpu = decode_choices("cpu", byte_tokenizer, True, positions="rank", rank_steps=rank_steps)
    gpu = decode_choices("cuda", byte_tokenizer, True, positions="rank", rank_steps=rank_steps)
    assert all(torch.equal(a, b) for a, b in zip(cpu[0], gpu[0]))
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-3, atol=1e-3)
