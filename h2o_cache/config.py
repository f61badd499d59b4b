"""Cache configuration: how many tokens each layer/head keeps and which policy picks them."""

from __future__ import annotations

from dataclasses import dataclass

from h2o_cache.policies import POLICIES, get_policy

# What a recall block's digest can be (`CacheConfig.recall_digest`, `archive.block_digests`): "centre",
# the keys' mean per channel (a box of no width: q . centre scores the block, and lo and hi share
# their storage, so a choice reads half the bytes); "mean", ArkVale's centre -/+ the mean absolute
# deviation per channel; or "minmax", Quest's channel-wise min and max. Each is read as a box [lo, hi]
# whose corner best aligned with the query scores the block.
DIGESTS = ("centre", "mean", "minmax")

# Where a row with a recall window gives its held keys positions (`CacheConfig.recall_positions`): "text",
# own tokens at their slots and each window token between the two own tokens around its origin (a
# fraction of a slot apart: `recall.text_positions`), or "rank", every held token, own and window, at
# its rank in the order of the text among them (`recall.held_ranks`: a permutation of the row's slots).
POSITIONS = ("text", "rank")


@dataclass(frozen=True)
class CacheConfig:
    """Budget and policy of an `H2OCache`.

    budget: most tokens a layer/KV head ever holds between passes (ignored by `full`).
    evict_slack: a cache that outgrows its budget is evicted down to `budget - evict_slack`
        (`target`), so compaction and re-rotation run once every `evict_slack` decode steps
        instead of every step. Default budget // 16; 1 evicts one token per step like the paper.
    heavy_ratio: share of the target given to heavy hitters (`h2o`); the rest, less the sinks,
        is the recent window. The H2O paper's default splits half and half.
    sink_tokens: first tokens always kept (attention sinks). `streaming` defaults to 4.
    recent_window: explicit recent window; by default `target - heavy - sinks`.
    position_rolling: give cached keys the positions of their slots (0..n-1) instead of their
        original positions, so RoPE never sees a position beyond the budget.
    prefill_chunk: longest chunk of prompt fed in one forward; bounds prefill memory to
        O(chunk x (budget + chunk)) per head.
    recall_budget: slots per layer/KV head of a row's recall window (`h2o_cache.recall`): copies of
        the blocks of the row's archive of evicted tokens (`h2o_cache.archive`) that the latest
        queries point at, held on top of the budget, so a row holds at most budget + recall_budget.
        0 drops evicted tokens.
    recall_block: tokens per archive block, the unit of recall (recall_budget is a multiple of it).
    recall_digest: what a block's digest is, by which the choices rank blocks before their tokens'
        exact logits (`DIGESTS`): "centre" (the keys' mean: q . mean ranks the block), "mean"
        (the keys' mean -/+ their mean absolute deviation, ArkVale) or "minmax" (their channel-wise
        min and max, Quest).
    recall_archive: most evicted tokens per layer/KV head a row archives; the oldest go first.
    recall_probe: the last tokens of a turn's prompt, fed as chunks of their own so that their
        queries (the question) choose the window the reply starts with.
    recall_probe_break: the probe starts after the last blank line within those tokens, where there is
        one (a question set apart from the document it asks about), so that the question's queries
        alone choose (`Generator.probe_start`).
    recall_burst: decode passes after each prefill that all choose the window by the last queries
        (where a reply starts to answer about the prompt), before choices every `recall_interval`.
    recall_interval: decode passes between two choices of the window by the last queries after the
        burst, for a row that decodes alone; where n rows decode in a pass, n x recall_interval (at
        most `recall_interval_max`), so that a batch's choices cost about one row's every
        recall_interval passes whatever its size (every prefill chunk chooses with its own queries).
    recall_interval_max: the longest interval between two choices, however many rows decode (at
        or below recall_interval: the interval does not grow with the rows).
    recall_voters: the layers whose heads' attention votes in the choices every `recall_interval`
        after a reply's burst, evenly spaced (`voter_layers`): only their keys are read, and every head
        of every layer takes its tokens by their votes (0, or the model's layers: all of them; a
        reply's first `recall_burst` choices always pool every layer's votes).
    recall_margin: in a decode step's choice after the burst, each head ranks the tokens its window
        holds with their votes times 1 + recall_margin, so a held token stays unless a token not held
        beats it by that margin: fewer of the window's slots are rewritten at each choice (0: by the
        votes alone; a burst's choices always go by the votes alone).
    recall_sweep: a decode choice after a reply's first ranks by the digests only each voting head's
        candidate blocks of its last choice, those of the reply's first choice (by its question) and the
        next `recall_sweep` blocks of the archive in turn (`archive.Sweep`), not every block, so that its
        cost stops growing with the archive; a reply's first choice ranks every block (0: every choice
        does).
    recall_queries: most queries per query head of a chunk of a prompt's body (a pass told `ahead`)
        that choose its window, evenly spaced and ending at the chunk's last token (None: all of
        them); the chunks of its tail (where the question is) choose by all of theirs.
    recall_span: a decode step's choice takes each archived token by the votes of the positions
        within this distance of its own (`selection.span_votes`), so that a phrase's words that drew
        no attention come back with those that did (0: its own votes only).
    recall_ahead: a chunk of a prompt's body (a pass told `ahead`: not the question's tail) is given,
        before its pass, the window the previous chunk's queries choose, all layers in one choice
        (each layer's heads pooling alone), instead of choosing layer by layer with its own queries
        inside the pass; the tail always chooses with its own.
    recall_choices: most rows that make their due decode-time choice before one decode pass; the
        others stay due for the next (a reply's first choice, by its question, goes first; then the
        rows in turn). None: every due row. A choice that runs on the host for a cache on a GPU costs
        more than a whole batched step there (RESULTS.md, "The GPU path, run"), so a server on a GPU
        caps it.
    recall_overlap: the fast step (`StaticDecoder`) makes a decode pass's due choices (all but a reply's
        first) while the pass runs on the device, by the queries of the pass before it, so that the
        window it chooses is read from the pass after (one pass older than choosing before the pass):
        the host's choice hides behind the device's step. None: on a GPU, not on the CPU, whose step
        runs on the same cores as the choice.
    recall_kernel: a decode step's choice over all layers runs in one C++ call on the CPU
        (`h2o_cache.native_recall`) where it can; False keeps the torch ops (the reference).
    recall_positions: where a row's held keys stand for RoPE (`POSITIONS`): "text" (own keys at their
        slots, recalled ones between them) or "rank" (the default), every held key at its rank in the
        order of the text, so that a recalled phrase keeps one position per word, in the passes that
        `recall_rank_steps` names, rotated from the keys as fed as the pass reads them
        (`recall.rank_rotated`, the native step, `decode_step`); the buffers keep the text layout.
        Measured in RESULTS.md, "Positions", "Ranks at every pass" and "Ranks for a reply's first 32
        steps" (better on long documents; a step at ranks ~0.15x of a step dearer).
    recall_reread: most tokens of a turn's own text that a turn whose body overflows the budget feeds
        again before its tail (`h2o_cache.reread`): the passages its reply's first steps point at, found
        by a greedy look on a copy of the row (0: off; with recall only).
    recall_reread_look: decode steps of that look (>= 2: the first step is what the others are
        measured against).
    recall_reread_dense: most tokens of the row (its newest, its own slots and its archive) that the
        look attends to at once, each at its place in the text, as a full cache would (a transient
        1-row cache of that many tokens); 0: the look reads through the recall window, as a decode
        step does. Either way no more than the model's positions.
    recall_rank_steps: with "rank", a reply's first decode passes (after each prefill) that read the
        held keys at their ranks, after which its passes read the text layout until the next prompt;
        every prefill pass reads ranks (None: every pass). A reply's answer about a long prompt is
        read at ranks, and a long reply's steps cost what the text layout's do.
    """

    policy: str = "h2o"
    budget: int = 256
    heavy_ratio: float = 0.5
    sink_tokens: int | None = None
    recent_window: int | None = None
    evict_slack: int | None = None
    position_rolling: bool = True
    prefill_chunk: int = 512
    recall_budget: int = 0
    recall_block: int = 8  # measured: a pass key at depth 0% of a 4k prompt 0.95 with 8, 0.80 with 16
    # measured (RESULTS.md, "A digest of no width"): the 256 blocks a decode step's queries rank first by
    # the keys' mean hold 0.731 / 0.449 / 0.266 of the step's attention over a 4k / 8k / 16k archive, by
    # the mean -/+ deviation 0.705 / 0.417 / 0.237 (the best 256: 0.751 / 0.476 / 0.292), reading half the bytes
    recall_digest: str = "centre"
    # a 30-turn chat's re-read passages (~150 tokens a turn) took it past 16384 archived tokens, and its
    # first turn's pass key was dropped: 0 of 10 (RESULTS.md, "A look that reads every token")
    recall_archive: int = 24576
    recall_probe: int = 64
    # measured (RESULTS.md, "The question alone probes" and "A probe after the blank line trades one form
    # for another"): a code said once in a ~2k / ~4k-token message 19/24 / 30/36 after the blank line
    # against 15/24 / 25/36 probing with the last 64 tokens, but three secrets listed in one answer 44/60
    # against 52/60 (full 54) and a name said once 2/30 against 6/30 (full 14): off, here and in the server
    recall_probe_break: bool = False
    recall_burst: int = 16  # measured: 30-turn pass key 5/5 choosing every step, 3/5 every 16th
    # measured (RESULTS.md, "How often a decode step chooses"): 160-token continuations of a 2k-token
    # text lose 0.044 nats/token choosing every 16th step against every step, 0.015 every 4th, and every
    # 32nd is as good as every 16th; with 5 voting layers and a margin of 0.3 (RESULTS.md, "Every step
    # alone") every step scores 3.438 against every 3rd's 3.446 ([-0.016, -0.000]), at 1.18-1.28x a
    # batch-1 CPU step without recall (median of 6 runs 1.23; every 3rd: 1.10-1.14x); a batch of 8, each
    # row every 8th, 3.467 against every 24th's 3.485, at 1.15-1.34x (median 1.22); measured again
    # (RESULTS.md, "Every second step"): every 2nd step +0.0104 [+0.0033, +0.0189] against every step,
    # and skipping a choice where the voters' queries stay close to the last choice's no way out (a
    # cosine of 0.9 skips 7% of choices, +0.0028 [-0.0003, +0.0069]; 0.8 skips 71%, +0.0218)
    recall_interval: int = 1
    recall_interval_max: int = 32
    # measured: continuations' NLL with 5 of 30 layers voting equals all 30's at every interval tried
    # (every 4th 3.453 vs 3.451, every 16th 3.479 vs 3.481; every step, layers 2, 8, .., 26 by the
    # torch ops: 3.435 vs 3.436); a choice reads a sixth of the keys, but its tokens' copies stay:
    # ~1.9 ms in a batch-1 loop against ~2.7 ms. Then 2 (layers 7 and 22) against 5 (RESULTS.md, "Two
    # voting layers"): the continuations -0.0017 [-0.0102, +0.0070] nats/token on botchan.txt and
    # -0.0008 [-0.0109, +0.0069] on XSum's articles, three secrets listed 52 of 60 against 51 (full 54),
    # a batch-1 step 1.32x recall off at steady state against 1.41-1.53x (3 layers: +0.0074, 1: +0.0133)
    recall_voters: int = 2
    # measured: halves the slots a choice rewrites (4,326 -> 2,128 a step) at the same NLL at every step
    # (3.4366 vs 3.4363 with all layers voting and no margin). With 5 voting layers 0.5 and 0.7 scored
    # worse (3.4434, 3.4458 against 3.4372); with 2 (RESULTS.md, "Two voting layers") 1.0 scores as 0.3
    # (-0.0011 [-0.0055, +0.0034] on botchan.txt, -0.0005 [-0.0054, +0.0044] on XSum's articles; three
    # secrets 52 of 60) for a batch-1 step 0.05-0.07 cheaper
    recall_margin: float = 1.0
    # measured (RESULTS.md, "A quarter of a body chunk's queries choose"): with the re-read, 32 of a body chunk's
    # 128 queries, the question's all, find the pass keys of a 4k prompt's last quarter 0.95 / 1.00 (all: 1.00 /
    # 1.00; 16: 0.90 / 0.90) at a quarter of a chunk's products; 16 of every chunk's, the question's too, listed
    # 51 of 60 secrets against 59
    recall_queries: int | None = 32
    # measured (RESULTS.md, "A choice that stops growing with the archive"): pass keys at depths 75 / 90% of
    # ~8k-token prompts 1.00 / 1.00 with 512 as with every block at every choice, 0.90 / 0.90 with 128
    recall_sweep: int = 512
    recall_span: int = 4  # measured: 2k pass key at depth 15% 1.00 (whole blocks: 0.45)
    recall_ahead: bool = False  # measured: prefill 1.23x recall-off (16 queries), but 1k pass keys 0.85-0.90, not 1.00
    recall_choices: int | None = None
    recall_overlap: bool | None = None
    recall_kernel: bool = True
    # measured (RESULTS.md, "Ranks for a reply's first 32 steps"): ranks in every prefill pass and a
    # reply's first 32 steps find a code said once in ~4k-token messages 25 times in 36 (as ranks at every
    # step; text: 18), list 51 of 60 (text 50), score long continuations as the text layout (-0.0007
    # [-0.0085, +0.0085]) and XSum as the full cache (text: 0.017 better than that); the steps after the
    # 32nd cost what the text layout's do (ranks at every step: 1.44x at batch 1 on real text, 1.27x at 8)
    recall_positions: str = "rank"
    recall_rank_steps: int | None = 32
    recall_reread: int = 96
    recall_reread_look: int = 16
    recall_reread_dense: int = 8192

    def voter_layers(self, layers: int) -> list[int] | None:
        """The layers of a model of `layers` whose attention votes in the choices after a reply's burst:
        the middle layer of each of `recall_voters` equal spans (None: every layer)."""
        if not self.recall_voters or self.recall_voters >= layers:
            return None
        return [(2 * i + 1) * layers // (2 * self.recall_voters) for i in range(self.recall_voters)]

    def choice_interval(self, rows: int) -> int:
        """Decode passes between two choices of a row's window when `rows` rows decode together."""
        return min(self.recall_interval * max(rows, 1), max(self.recall_interval_max, self.recall_interval))

    def __post_init__(self) -> None:
        policy = get_policy(self.policy)
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.recall_budget:
            if not (policy.evicts and self.position_rolling):
                rolling = "" if self.position_rolling else " without position rolling"
                raise ValueError(f"recall needs an evicting policy with position rolling, not {self.policy!r}{rolling}")
            if self.recall_block < 1 or self.recall_budget % self.recall_block:
                raise ValueError(f"recall_budget ({self.recall_budget}) must be a multiple of recall_block ({self.recall_block})")
            _one_of("recall_digest", self.recall_digest, DIGESTS)
            _one_of("recall_positions", self.recall_positions, POSITIONS)
            if self.recall_archive < self.recall_budget:
                raise ValueError(f"recall_archive ({self.recall_archive}) must hold at least recall_budget ({self.recall_budget})")
            if self.recall_probe < 1:
                raise ValueError(f"recall_probe must be >= 1, got {self.recall_probe}")
            if self.recall_interval < 1:
                raise ValueError(f"recall_interval must be >= 1, got {self.recall_interval}")
            if self.recall_interval_max < 1:
                raise ValueError(f"recall_interval_max must be >= 1, got {self.recall_interval_max}")
            if self.recall_voters < 0:
                raise ValueError(f"recall_voters must be >= 0, got {self.recall_voters}")
            if not self.recall_margin >= 0:
                raise ValueError(f"recall_margin must be >= 0, got {self.recall_margin}")
            if self.recall_queries is not None and self.recall_queries < 1:
                raise ValueError(f"recall_queries must be >= 1 or None, got {self.recall_queries}")
            if self.recall_sweep < 0:
                raise ValueError(f"recall_sweep must be >= 0, got {self.recall_sweep}")
            if self.recall_span < 0:
                raise ValueError(f"recall_span must be >= 0, got {self.recall_span}")
            if self.recall_choices is not None and self.recall_choices < 1:
                raise ValueError(f"recall_choices must be >= 1 or None, got {self.recall_choices}")
            if self.recall_burst < 0:
                raise ValueError(f"recall_burst must be >= 0, got {self.recall_burst}")
            if self.recall_rank_steps is not None and self.recall_rank_steps < 0:
                raise ValueError(f"recall_rank_steps must be >= 0 or None, got {self.recall_rank_steps}")
            if self.recall_reread < 0:
                raise ValueError(f"recall_reread must be >= 0, got {self.recall_reread}")
            if self.recall_reread_look < 2:
                raise ValueError(f"recall_reread_look must be >= 2 (its first step is the baseline), got {self.recall_reread_look}")
            if self.recall_reread_dense < 0:
                raise ValueError(f"recall_reread_dense must be >= 0, got {self.recall_reread_dense}")
        if self.recall_budget < 0:
            raise ValueError(f"recall_budget must be >= 0, got {self.recall_budget}")
        if not policy.evicts:
            return
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {self.budget}")
        if self.evict_slack is not None and not 1 <= self.evict_slack < self.budget:
            raise ValueError(f"evict_slack must be in [1, budget), got {self.evict_slack}")
        if not 0.0 <= self.heavy_ratio <= 1.0:
            raise ValueError(f"heavy_ratio must be within [0, 1], got {self.heavy_ratio}")
        if self.sink_tokens is not None and self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.recent_window is not None and self.recent_window < 1:
            raise ValueError(f"recent_window must be >= 1, got {self.recent_window}")
        if self.sinks + self.recent > self.target:
            raise ValueError(
                f"budget ({self.budget}, evicting down to {self.target}) is smaller than the recent "
                f"window ({self.recent}) plus sink tokens ({self.sinks}) of policy {self.policy!r}"
            )

    @property
    def evicts(self) -> bool:
        return get_policy(self.policy).evicts

    @property
    def slack(self) -> int:
        if self.evict_slack is not None:
            return self.evict_slack
        return max(1, self.budget // 16)

    @property
    def target(self) -> int:
        """Tokens kept per layer/head right after an eviction."""
        return self.budget - self.slack

    @property
    def sinks(self) -> int:
        if self.sink_tokens is not None:
            return self.sink_tokens
        return get_policy(self.policy).default_sinks

    @property
    def heavy(self) -> int:
        """Heavy-hitter slots at eviction: the part of the target chosen by score, not recency."""
        if not get_policy(self.policy).uses_heavy_hitters:
            return 0
        if self.recent_window is not None:
            return max(self.target - self.sinks - self.recent_window, 0)
        return int(self.target * self.heavy_ratio)

    @property
    def recent(self) -> int:
        if self.recent_window is not None:
            return self.recent_window
        return max(self.target - self.heavy - self.sinks, 1)

    @property
    def rolling(self) -> bool:
        """Rolling only changes anything when tokens are evicted."""
        return self.position_rolling and self.evicts

    @property
    def recalls(self) -> bool:
        return self.recall_budget > 0

    @property
    def ranks(self) -> bool:
        """Whether rows with a recall window read their held keys at their ranks in some passes."""
        return self.recalls and self.recall_positions == "rank"

    def describe(self) -> str:
        if not self.evicts:
            return self.policy
        rolling = "rolling" if self.rolling else "no-rolling"
        recall = f", recall={self.recall_budget}" if self.recalls else ""
        if self.recalls and self.recall_choices is not None:
            recall += f", {self.recall_choices} choice{'s' if self.recall_choices > 1 else ''} per step"
        return (
            f"{self.policy}(budget={self.budget}, heavy={self.heavy}, recent={self.recent}, "
            f"sinks={self.sinks}, slack={self.slack}, {rolling}{recall})"
        )


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Refuse a field's value outside its choices, naming them: "x must be 'a' or 'b', got 'c'"."""
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(choice) for choice in choices)}, got {value!r}")


__all__ = ["CacheConfig", "POLICIES"]
