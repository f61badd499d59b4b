"""`StaticDecoder`: the fast decode path over a batch cache preallocated at its final shape.

The budget fixes every row's size, so the batch cache is allocated once at
[layers, max_rows, H_kv, budget + recall_budget + 1, D] and never moves. A step feeds every row
its pending token through `decode.decode_step`, padded to a bucket of 1, 2, 4, ... rows; per-row
inputs reach the device in one upload. On CUDA each bucket's step is captured once as a CUDA graph and replayed
(as in nano-vllm); elsewhere it runs eagerly, still without per-layer Python bookkeeping.

On the CPU, a model loaded from a GGUF file multiplies by the file's own Q4_1 / Q8_0 blocks
(`quantized.py`) in buckets of up to `QUANTIZED_MAX_ROWS` rows: the step reads 5-6x fewer bytes
than the fp32 weights, and the weights it uses are the same fp32 values. Where every matrix is in
blocks, the whole step is one C++ call (`quantized.NativeStep`), the same math without per-op costs,
for buckets of any size.

Eviction stays outside the step: `H2OCache.evict_over_budget` evicts exactly the rows that crossed
the budget, with the same ops as the transformers path, so both paths keep the same tokens. A caller
that samples (the server's runner) evicts after sampling, so the sampled tokens do not wait for it.

With recall, the step also leaves every row's queries before RoPE in the cache's fixed buffer (a
write, no read-back); after a prefill, through a reply's first `recall_burst` steps and then every
`recall_interval` steps, they choose each row's recall window at the start of the next step
(`H2OCache.choose_due`, as the transformers path does). The choice runs on the archive in host
memory, outside the step and its graphs; the step's shapes and buffers never change. On a GPU
(`CacheConfig.recall_overlap`) the choices after a reply's first run while the device runs the step:
their queries are copied down before it, and the windows they write are queued behind it, for the
step after (a window one step older than before the step).
"""

from __future__ import annotations

import logging

import torch

from h2o_cache.cache import FIRST, H2OCache
from h2o_cache.config import CacheConfig
from h2o_cache.decode import decode_step, rope_table
from h2o_cache.hf import decoder_weights, model_spec
from h2o_cache.quantized import EXACT, NativeStep, fastest_activations, gguf_matrices, kernel
from h2o_cache.transfer import download

log = logging.getLogger(__name__)

# Above this many rows MKL's fp32 products beat the quantized kernel called op by op on a 2-core AVX2
# CPU (`python -m h2o_cache.bench.speed --only fast-vs-eager`); the native step beats them at any size.
QUANTIZED_MAX_ROWS = 16
# From this many rows in a bucket the native step reads the recall windows from their fp16 copy. It was
# 4 while one row's attention read its rows cold, page by page, where widening fp16 cost about what the
# bytes saved (30 layers of attention over 256 + 128 slots on the 2-core Zen 5, C++ outside the repo: 1
# row 0.66 ms with the copy against 0.55 without, 2 rows 1.46 against 1.26, 4 rows 3.1 both, 8 rows 5.5
# against 5.9). Since attention fetches its rows ahead (`kernels/cpu_decode.cpp`, ATTENTION_AHEAD) the
# bytes are what it waits for: with the copy a recall step took 0.954-0.965x as long at batch 1 and 0.954x
# at batch 2 (the 2-vCPU Intel VM, in one process, toggled between windows of 32 steps, 12-20 rounds).
# The copy is exact, so the choice changes no result.
WINDOW_COPY_MIN_ROWS = 1


def buckets(max_rows: int) -> list[int]:
    """Batch sizes a step is padded to: powers of two below max_rows, then max_rows."""
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return sizes + [max_rows]


class StaticDecoder:
    """Decode steps for one batch cache of at most `max_rows` rows.

    `cache` is the batch: add rows with `cache.extend`, remove them with `cache.pop`; every row must
    hold exactly one pending token when `step` runs. Requires an evicting policy with position
    rolling (the fixed shape and the bounded RoPE positions are what make the step static).
    cuda_graphs: None captures them on CUDA devices only.
    quantized: multiply by the GGUF file's quantized matrices (`model.gguf_path`) in buckets of at
    most QUANTIZED_MAX_ROWS rows; None does where it can (an fp32 model on the CPU, from a GGUF file
    with Q4_1 / Q8_0 matrices, and a compiled kernel).
    native: run those buckets as one C++ call (`NativeStep`); None does where the model allows it, False
    keeps `decode_step`'s torch ops (the reference, for comparisons).
    exact: the native step multiplies the fp32 activations by the weights' exact values; else (the
    default) it quantizes them per 32-block to int8 and uses integer dot products, as llama.cpp does
    (AVX-512 VNNI where the CPU has it): faster products and an NLL +0.13% above the exact one
    (`python -m h2o_cache.bench.activations`, RESULTS.md). The torch-ops path is always exact.
    share: another decoder of the same model whose packed matrices this one reads too (not packed twice).
    """

    def __init__(self, model, config: CacheConfig, max_rows: int, cuda_graphs: bool | None = None,
                 quantized: bool | None = None, native: bool | None = None, exact: bool = False,
                 share: StaticDecoder | None = None):
        if not config.rolling:
            raise ValueError(f"static decode needs an evicting policy with position rolling, not {config.describe()}")
        self.spec = model_spec(model)
        self.weights = decoder_weights(model)
        self.quantized_weights = None
        gguf_path = getattr(model, "gguf_path", None)
        if quantized is None:
            quantized = self.spec.device.type == "cpu" and gguf_path is not None and kernel() is not None
        if quantized and share is not None and share.quantized_weights is not None:
            self.quantized_weights = share.quantized_weights
        elif quantized:
            if gguf_path is None or kernel() is None:
                raise ValueError("quantized decoding needs a model loaded from a GGUF file and the compiled kernel")
            packed = gguf_matrices(gguf_path, model)
            if packed:
                self.quantized_weights = decoder_weights(model, packed)
        self.config = config
        if config.recalls and config.recall_kernel:
            kernel()  # the recall choices' (on any device): built now, not during a request's first choice
        self.max_rows = max_rows
        self.buckets = buckets(max_rows)
        device = self.spec.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.cache = H2OCache(self.spec, config)
        # recalled tokens sit on top of the budget; the batch evicts every few steps: keep the scratch
        self.cache.reserve(max_rows, config.budget + config.recall_budget + 1, scratch=True)
        self._storage = self.cache.buffers().keys  # what the steps (and graphs) read
        self._cos, self._sin = self.spec.rope.get(config.budget + config.recall_budget + 1)
        self._rope = rope_table(self._cos, self._sin)  # what the torch step (a CUDA graph's body) reads
        self.queries = self.cache._queries  # [L, max_rows, H_q, D] with recall: each row's last queries before RoPE
        self.steps = 0
        overlap = config.recall_overlap
        self.overlap = config.recalls and (device.type == "cuda" if overlap is None else overlap)
        self._serial_once = False  # a choice beside the step raised: the next step's choices go before it
        self.native = None
        if native is not False and self.quantized_weights is not None:
            args = (self.quantized_weights, self.cache.buffers(), self._cos, self._sin)
            if NativeStep.supports(*args):
                self.cache.keep_window_copy()  # with recall: the step reads the windows in fp16
                self.native = NativeStep(*args, max_rows=max_rows, queries=self.queries,
                                         activations=EXACT if exact else fastest_activations(),
                                         window=self.cache.window_copy(),
                                         ranks=config.ranks)
        if native and self.native is None:
            raise ValueError("the native step needs a model whose every matrix is Q4_1 / Q8_0 blocks, and the kernel")
        # A bucket's tokens, slots, origins and whether each row reads its keys at their ranks ([4, bucket];
        # with rolling a new token's RoPE position is its slot) are the first 4 x bucket values: the upload
        # is one contiguous copy for every bucket.
        self._inputs = torch.zeros(4 * max_rows, dtype=torch.int64, device=device)
        self._staging = torch.zeros(4 * max_rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        # (bucket, whether some row reads ranks) -> its graph and logits: with ranks a bucket has two, so
        # that a step where no row reads ranks (every reply past its first `recall_rank_steps`) skips them
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        if self.cuda_graphs:
            self._capture()

    def step(self, evict: bool = True) -> torch.Tensor:
        """Feed every row its pending token; returns fp32 logits [B, V] (a view valid until the next step).

        Rows that cross the budget are evicted before this returns, or with evict=False by the caller
        (`cache.evict_over_budget()`, after sampling) or else first thing in the next step; then
        nothing that can raise runs after the rows are fed, so a failed step can be retried on the
        transformers path without feeding a token twice. With recall, the rows whose choice is due
        (`H2OCache.choose_due`: a reply's first `recall_burst` steps, then every `recall_interval`)
        choose their windows by the last queries first (a choice that raises does so before anything
        is fed); pending tokens are left for the caller to replace with the next sampled ones. With
        `overlap` (a GPU's default, `CacheConfig.recall_overlap`) only a reply's first choice goes
        before the step: the others run on the host while the device runs it (`_advance_choosing`).
        """
        cache = self.cache
        rows = cache.batch_size
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"a step needs 1..{self.max_rows} rows, the cache has {rows}")
        try:
            tokens = [token for token, in cache.pending]
        except ValueError:
            raise ValueError("every row needs exactly one pending token to decode") from None
        cache.evict_over_budget()  # rows a step with evict=False left over the budget
        if cache.buffers().keys is not self._storage:
            raise RuntimeError("the batch cache was reallocated; its graphs would read freed memory")
        bucket = next(b for b in self.buckets if b >= rows)
        beside, queries = self._choose_before()
        # the last step's upload has left the staging buffer (long since: its tokens were downloaded)
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()
        staged = self._staging[:4 * bucket]
        ranked = [int(cache.ranked(row)) for row in range(rows)]
        staged.view(4, bucket)[:, :rows] = torch.tensor([tokens, cache.lengths, cache.seen, ranked])
        staged.view(4, bucket)[:, rows:] = 0  # padding rows write slot 0 of rows nobody uses
        self._inputs[:4 * bucket].copy_(staged, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        reads_ranks = cache.config.ranks and any(ranked)
        if self.cuda_graphs:
            graph, logits = self._graphs[bucket, reads_ranks]
            graph.replay()
        else:
            logits = self._run(bucket, reads_ranks)
        if beside:
            self._advance_choosing(beside, queries, evict)
        else:
            cache.advance([1] * rows, evict=evict)
        self.steps += 1
        return logits[:rows]

    def _choose_before(self) -> tuple[list[int], tuple | None]:
        """The choices due before a step: made here, or with `overlap` (all but a reply's first, which
        answers its question) left to run beside the step. Returns those rows and their queries' host
        copy on its way down (`download`'s views and event), taken before the step overwrites them."""
        cache = self.cache
        if not self.overlap or self._serial_once:
            self._serial_once = False
            cache.choose_due()
            return [], None
        first = [row for row, due in enumerate(cache.due) if due == FIRST]
        if first:
            cache.choose_due(first)
        beside = cache.choosing()
        if not beside:
            return [], None
        picked = torch.stack([self.queries[:, row] for row in beside], dim=1)
        if picked.device.type != "cuda":  # the CPU (tests): nothing to wait for
            return beside, (picked, None)
        (picked,), copied = download([(picked,)])
        return beside, (picked[0], copied)

    def _advance_choosing(self, beside: list[int], queries: tuple, evict: bool) -> None:
        """After a step is queued: count its tokens, make the choices of `beside` on the host while the
        device runs the step, by the queries of the step before it (the windows they write are queued
        behind the step, so the next step reads them), then evict the rows over budget with `evict`. A choice that
        raises here, after the step fed its tokens, leaves its row due and the next step's choices
        go before it, where a raise comes before anything is fed."""
        cache, rows = self.cache, self.cache.batch_size
        due, cache.due = cache.due, [0] * rows
        cache.advance([1] * rows, evict=False)  # the choices first: an eviction's archiving waits for the step
        later, cache.due = cache.due, due  # the choices due after this step, kept for the next
        try:
            picked, copied = queries
            if copied is not None:
                copied.synchronize()  # the copy was queued before the step: waits for the step before it
            host = picked.new_zeros(picked.shape[0], rows, *picked.shape[2:])
            host[:, beside] = picked
            cache.choose_due(beside, host)
        except Exception:
            log.warning("a recall choice beside the step failed; the next step chooses before it", exc_info=True)
            self._serial_once = True
        finally:
            cache.due = [max(now, after) for now, after in zip(cache.due, later)]
        if evict:
            cache.evict_over_budget()

    def inputs(self, bucket: int) -> torch.Tensor:
        """[4, bucket] int64 on the device: the tokens, slots, origins and rank flags (1: the row reads its
        held keys at their ranks, `H2OCache.ranked`) a step of `bucket` rows reads."""
        return self._inputs[:4 * bucket].view(4, bucket)

    def _run(self, bucket: int, reads_ranks: bool = True) -> torch.Tensor:
        """A step of `bucket` rows; reads_ranks: False where no row reads its held keys at their ranks
        (the torch step then leaves them out; the native step reads each row's flag itself)."""
        tokens, slots, origins, ranks = self.inputs(bucket)
        if self.native is not None:  # faster than MKL's fp32 products at every batch up to 64, at least
            copy = self.native.window is not None and bucket >= WINDOW_COPY_MIN_ROWS
            self.cache.read_window_copy(copy)  # the choices before the next step write it, or mark its rows
            if copy and self.cache.window_copy() is not self.native.window:
                raise RuntimeError("the window's copy was reallocated; the native step would read freed memory")
            cache = self.cache  # the rows' rank flags as staged for this step (a CPU tensor here)
            ranked = ([r if flag else 0 for r, flag in zip(cache.recalled, ranks.tolist())]
                      if cache.config.ranks else None)
            return self.native(tokens, slots, origins, cache.recalled if copy else None, ranked=ranked,
                               epochs=cache.epochs)
        weights = self.weights
        if self.quantized_weights is not None and bucket <= QUANTIZED_MAX_ROWS:
            weights = self.quantized_weights
        return decode_step(weights, self.cache.buffers(), tokens, slots, slots, origins, self._rope, self.queries,
                           ranks if self.cache.config.ranks and reads_ranks else None)

    def _capture(self) -> None:
        """One graph per bucket (two with ranks: with and without them), largest first, sharing one
        memory pool (one replays at a time). Runs while no row is in the cache: warm-up passes write
        only slots of rows that are not in use yet."""
        assert self.cache.batch_size == 0
        pool = None
        kinds = [(bucket, ranks) for bucket in reversed(self.buckets)
                 for ranks in ((True, False) if self.cache.config.ranks else (False,))]
        warmup = torch.cuda.Stream(self.spec.device)
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warmup):
            for kind in kinds:
                self._run(*kind)
        torch.cuda.current_stream().wait_stream(warmup)
        for kind in kinds:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run(*kind)
            pool = graph.pool()
            self._graphs[kind] = (graph, logits)
        torch.cuda.synchronize(self.spec.device)
