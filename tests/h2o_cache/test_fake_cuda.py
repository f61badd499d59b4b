"""The GPU path, run on a fake CUDA device in bf16 (`tests.device_audit.FakeCuda`): weight preparation,
one CUDA graph per bucket, the fast step for every bucket, the batched sampler, eviction with the
archive's store, a recall, and a prefill chunk, on a machine without CUDA, as CI runs it.

It fails on any op that needs a device value on the host, any op mixing devices, and any dtype the
eager path would not have; and it holds a decode step to one host sync (the sampled tokens'
download) on quiet and evicting steps, at batch 1 and batch 64.
"""

import pytest
import torch

from h2o_cache import CacheConfig, Generator, Sampler, SamplingParams, StaticDecoder, reread, sample
from tests.conftest import ByteTokenizer, tiny_llama
from tests.device_audit import FakeCuda

# FakeTensorMode warns when code asks a fake tensor for its address (weights' storage sharing)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor"),
    # the audit models a CPU-only build: on a CUDA build (an H200, 2026-11-27) a blocking upload takes a
    # route it does not see, and its own check fails; there tests/h2o_cache/test_cuda.py runs instead
    pytest.mark.skipif(torch.backends.cuda.is_built(), reason="fake CUDA needs a CPU-only build of torch"),
]
CUDA = torch.device("cuda", 0)


def fake_cuda_model():
    return tiny_llama(init_std=0.3).to(CUDA, torch.bfloat16)


def test_the_audit_catches_what_it_must():
    with FakeCuda() as audit:
        x = torch.ones(4, device=CUDA)
        with pytest.raises(Exception):
            x.sum().item()
        with pytest.raises(RuntimeError, match="implicit upload"):
            x + torch.ones(4)
        torch.tensor([1, 2], device=CUDA)  # a blocking upload
        x.cpu()  # a blocking download
        x.to("cpu", non_blocking=True)  # into pinned memory: no sync
        pinned = torch.empty(4, pin_memory=True)
        pinned.copy_(x, non_blocking=True)
        torch.empty(4).copy_(x, non_blocking=True)  # to pageable memory: CUDA waits for it
        x.to(torch.float64)
        assert pinned.is_pinned() and not torch.empty(4).is_pinned()
    assert audit.forbidden and audit.mixed
    assert audit.syncs == 1 + 3 and audit.casts == [(torch.float32, torch.float64, 4)]


def prefilled(gen: Generator, n: int, token: int):
    row = gen.new_cache(1)
    gen.prefill(row, [[(7 * i + n) % 120 + 3 for i in range(n)]])  # chunks of 8: the first of them a whole chunk
    row.pending = [[token]]
    return row


SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
            SamplingParams(temperature=1.0, top_k=5, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3,
                           logit_bias=((7, 2.0),), seed=2),
            SamplingParams(repetition_penalty=1.3, logprobs=3)]


@pytest.mark.parametrize("rows", [1, 64])
def test_a_decode_step_syncs_once_on_quiet_and_evicting_steps(rows):
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        decoder = StaticDecoder(model, config, max_rows=64)
        assert decoder.cuda_graphs and sorted(decoder._graphs) == [(b, False) for b in (1, 2, 4, 8, 16, 32, 64)]
        assert decoder.weights.layers[0].qkv.dtype == torch.bfloat16 and decoder.weights.embed.is_cuda
        firsts = [prefilled(gen, n, 5 + n) for n in (16, 9, 13, 11)]
        for i in range(rows):
            decoder.cache.extend(firsts[i % 4])
        samplers = [Sampler(SAMPLING[i % 4], prompt=[3, 4, 5]) for i in range(rows)]
        syncs, evicting = [], []
        for _ in range(8):
            before, copies = audit.syncs, len(audit.copies)
            lengths = list(decoder.cache.lengths)
            logits = decoder.step(evict=False)
            drawn = sample(logits, samplers)  # as the runner does: sample, then evict
            decoder.cache.pending = [[d.token] for d in drawn]
            decoder.cache.evict_over_budget()
            syncs.append(audit.syncs - before)
            evicting.append(any(after < before for after, before in zip(decoder.cache.lengths, lengths)))
            assert all(c.contiguous for c in audit.copies[copies:])
            assert all(c.pinned and c.non_blocking for c in audit.copies[copies:] if c.upload)
        assert logits.dtype == torch.float32 and logits.shape == (rows, model.config.vocab_size)
        assert [d.logprob is not None for d in drawn] == [i % 4 == 3 for i in range(rows)]
    assert not audit.forbidden and not audit.mixed
    assert syncs == [1] * 8, syncs
    assert any(evicting) and not all(evicting)


def test_every_bucket_computes_attention_without_an_fp32_copy_of_the_keys_and_in_the_eager_paths_dtypes():
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        decoder = StaticDecoder(model, config, max_rows=8)
        eager = gen.new_cache(0)
        for n in (16, 9, 13):
            row = prefilled(gen, n, 5)
            decoder.cache.extend(row)
            eager.extend(row)
        expected = gen.step(eager, eager.pending)  # the transformers path
        _, _, heads, capacity, dim = decoder.cache.buffers().keys.shape
        for bucket in decoder.buckets:
            casts = len(audit.casts)
            logits = decoder._run(bucket)
            assert logits.dtype == expected.dtype and logits.device == expected.device
            # a copy of the bucket's keys for one layer, or larger
            wide = [c for c in audit.casts[casts:] if c[1] == torch.float32 and c[2] >= bucket * heads * capacity * dim]
            assert not wide, wide
        fast = decoder.step()
    assert not audit.forbidden and not audit.mixed
    assert fast.dtype == expected.dtype
    for name, buffer in vars(decoder.cache.buffers()).items():
        theirs = getattr(eager.buffers(), name)
        assert (buffer is None) == (theirs is None), name
        assert buffer is None or (buffer.dtype, buffer.device) == (theirs.dtype, theirs.device), name


def test_eviction_stores_to_the_archive_in_one_pinned_asynchronous_copy_and_a_recall_runs():
    """A step that evicts into the archive still syncs once: what it drops goes to pinned host memory
    in one contiguous asynchronous copy, landing in the archive when next read. A recall (the
    window's choice, on the host where the archive lives) runs without host reads on the device."""
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8, recall_budget=8, recall_block=4,
                         recall_archive=256, recall_burst=0, recall_interval=1000)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        decoder = StaticDecoder(model, config, max_rows=4)
        for n in (30, 10, 23):
            decoder.cache.extend(prefilled(gen, n, 5))
        samplers = [Sampler(SamplingParams()) for _ in range(3)]
        archived = decoder.cache.archived_tokens()
        decoder.cache.due = [False] * 3  # the choice after the prefill is the recall below: these steps count their own syncs
        for _ in range(8):
            before, copies = audit.syncs, len(audit.copies)
            drawn = sample(decoder.step(evict=False), samplers)
            decoder.cache.pending = [[d.token] for d in drawn]
            decoder.cache.evict_over_budget()
            assert audit.syncs - before == 1
            downloads = [c for c in audit.copies[copies:] if not c.upload]
            assert len(downloads) in (1, 2) and all(c.contiguous for c in downloads)
            assert all(c.pinned and c.non_blocking for c in downloads[1:])  # the eviction's
        assert decoder.cache.archived_tokens() > archived
        archive = decoder.cache.archives[0]
        assert archive.state()["keys"].dtype == torch.bfloat16 and not archive._incoming  # landed on read
        assert not archive._data["keys"].is_pinned()  # ordinary memory: PyTorch's pinned cache never shrinks
        decoder.cache.due = [True] * 3
        decoder.cache.choose_due()
        logits = decoder.step()
    assert not audit.forbidden and not audit.mixed
    assert logits.dtype == torch.float32


def test_choices_beside_the_step_wait_only_for_the_step_before_it():
    """On a GPU a due choice (after a reply's first) runs on the host while the device runs the step: its
    queries' download is queued before the step's graph, and once the graph is queued nothing waits
    for the device but that copy (the step before it, which the last token download already waited
    for). The step's only other sync is the caller's download of its sampled tokens."""
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8, recall_budget=8, recall_block=4,
                         recall_archive=256, recall_burst=4, recall_interval=1, recall_interval_max=1)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        decoder = StaticDecoder(model, config, max_rows=4)
        assert decoder.overlap
        for n in (30, 10, 23):
            decoder.cache.extend(prefilled(gen, n, 5))
        samplers = [Sampler(SamplingParams()) for _ in range(3)]
        beside = 0
        for step in range(6):
            first = 0 if step == 0 else len(audit.timeline)
            chose = any(decoder.cache.due) and step > 0
            logits = decoder.step(evict=False)
            timeline = audit.timeline[first:]
            replay = timeline.index(("replay",))
            before, after = timeline[:replay], timeline[replay + 1:]
            recorded = {entry[1] for entry in before if entry[0] == "record"}
            assert all(entry[0] == "record" or entry[0] == "wait" and entry[1] in recorded for entry in after), after
            if chose:
                beside += 1
                assert any(entry[0] == "wait" for entry in after)  # the choice ran after the graph was queued
            assert not decoder._serial_once  # and did not fail
            drawn = sample(logits, samplers)
            decoder.cache.pending = [[d.token] for d in drawn]
            decoder.cache.evict_over_budget()
    assert not audit.forbidden and not audit.mixed
    assert beside >= 3


def test_a_step_replays_its_buckets_graph_without_ranks_where_no_row_reads_them():
    """With ranks (`recall_positions` "rank") each bucket has two graphs; a step replays the one with
    ranks while some row is within its reply's first `recall_rank_steps`, and the one without them
    after, chosen on the host from the rows' flags (no read from the device)."""
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8, recall_budget=8, recall_block=4,
                         recall_archive=256, recall_positions="rank", recall_rank_steps=3)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        decoder = StaticDecoder(model, config, max_rows=4)
        assert sorted(decoder._graphs) == [(b, ranks) for b in (1, 2, 4) for ranks in (False, True)]
        replayed = []
        for kind, (graph, _) in decoder._graphs.items():
            graph.replay = lambda kind=kind, replay=graph.replay: (replayed.append(kind), replay())
        for n in (30, 23):
            decoder.cache.extend(prefilled(gen, n, 5))
        expected = []
        for step in range(6):
            if step == 2:  # a new reply joins: its first steps read ranks again
                decoder.cache.extend(prefilled(gen, 27, 6))
            cache = decoder.cache
            expected.append((4 if cache.batch_size > 2 else 2, any(cache.ranked(row) for row in range(cache.batch_size))))
            decoder.step()
            decoder.cache.pending = [[7 + step]] * decoder.cache.batch_size  # fake tensors hold no tokens to sample
    assert not audit.forbidden and not audit.mixed
    assert replayed == expected
    assert [ranks for _, ranks in expected] == [True, True, True, True, True, False]


def test_a_re_read_s_dense_row_is_built_on_the_device_from_the_host_archive():
    """The dense look's row (`reread.dense_row`, never yet run on a GPU): the row's own slots on the device,
    its archive uploaded from host memory a layer at a time, into a new cache or into the look's 1-row
    decoder's, with no host read of a device value and no op that mixes devices."""
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4, prefill_chunk=8, recall_budget=8, recall_block=4,
                         recall_archive=256)
    with FakeCuda() as audit:
        model = fake_cuda_model()
        gen = Generator(model, ByteTokenizer(), config)
        row = prefilled(gen, 40, 5)
        assert len(row.archives[0]) > 0
        size = reread.dense_size(row, 0, 1000)
        dense, origins, archived = reread.dense_row(row, 0, 1000, 9)
        look = StaticDecoder(model, reread.dense_config(config, size + 9), 1, cuda_graphs=False)
        into, _, _ = reread.dense_row(row, 0, 1000, 9, look.cache)
    assert not audit.forbidden and not audit.mixed
    assert into is look.cache and dense.lengths == into.lengths == [size]
    for buffers in (dense.buffers(), into.buffers()):
        assert buffers.keys.device == CUDA and buffers.keys.dtype == torch.bfloat16
        assert buffers.rotated.device == buffers.origins.device == CUDA
    assert origins.device == archived.device == CUDA and origins.shape[-1] == size
