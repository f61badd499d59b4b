"""Server settings: one pydantic-settings class that is also the `python -m server` command line.

Every field reads from a flag (`--kv-budget 256`) and an environment variable (`H2O_KV_BUDGET=256`);
a flag wins over the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, CliImplicitFlag, NoDecode, SettingsConfigDict

from h2o_cache import CacheConfig
from server.engine.types import EngineConfig

DEFAULT_RECALL = 128  # measured: a pass key told in turn 1 is recalled after 10 turns 10/10 (h2o alone 0/10)
DEFAULT_PREFILL_CHUNK = 256  # without recall: fewer, larger passes (prefill memory stays bounded)


def default_state_dir() -> str:
    """$XDG_DATA_HOME/h2o-chat, else ~/.local/share/h2o-chat (the XDG base directory rule)."""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return str(Path(data_home) / "h2o-chat")


class ServerSettings(BaseSettings):
    """OpenAI-compatible streaming chat server; each conversation keeps a fixed-budget H2O KV cache.
    Every flag is also an environment variable: --kv-budget 64 is H2O_KV_BUDGET=64."""

    model_config = SettingsConfigDict(
        env_prefix="H2O_", cli_prog_name="python -m server", cli_kebab_case=True, cli_implicit_flags=True,
        cli_hide_none_type=True, cli_avoid_json=True, protected_namespaces=(),
    )

    # ----- HTTP -------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0 for every interface)")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="accepted API key, repeatable; when any is set, requests need `Authorization: Bearer KEY` "
                    "(environment: comma-separated)",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="uvicorn log level")
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="browser origins allowed to call the API (CORS), repeatable, e.g. https://app.example or *; "
                    "none by default: no CORS headers (environment: comma-separated)")
    request_timeout: float | None = Field(
        None, gt=0, le=86400, description="seconds a request may run, prefill included; past it the reply is "
                                          "cancelled and the client gets a 504 request_timeout (in a stream: an "
                                          "error frame); unset: no limit")
    sse_keepalive: float = Field(
        15.0, gt=0, le=3600, description="seconds of silence in a stream (a long prefill) after which an SSE "
                                         "comment line is sent, so proxies and clients do not time it out")
    shutdown_timeout: float = Field(
        30.0, ge=0, le=3600, description="on SIGTERM/SIGINT: seconds in-flight replies get to finish (no new "
                                         "connection is accepted meanwhile) before they are cancelled")

    # ----- model ------------------------------------------------------------------------------------
    model: str | None = Field(
        None, description="Hugging Face model directory or .gguf file; unset: the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(
        None, description="model name reported by /v1/models and in responses; unset: derived from --model")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on cpu, bfloat16 (or float16) on cuda")
    prefill_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto", description="dtype of the prompt's MLP products (attention and decode steps keep --dtype's): auto: "
                            "bfloat16 for a float32 model on a CPU that multiplies bf16 natively (AVX512-BF16, AMX-BF16: "
                            "3-4x faster there), else --dtype's; int8: every product of a GGUF model's blocks "
                            "through the decode step's integer products (CPU)")
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch intra-op threads; unset: one per CPU core this process may use")

    # ----- KV cache ---------------------------------------------------------------------------------
    policy: Literal["h2o", "streaming", "local", "full"] = Field(
        "h2o", description="eviction policy: h2o (heavy hitters + recent), streaming (sinks + recent), "
                           "local (recent only), full (never evicts)")
    kv_budget: int = Field(256, ge=2, le=1_000_000, description="tokens each layer/KV head keeps (not for full)")
    heavy_ratio: float = Field(0.5, ge=0.0, le=1.0, description="share of the budget given to heavy hitters (h2o)")
    sink_tokens: int | None = Field(
        None, ge=0, le=1024, description="first tokens always kept; unset: the policy's default (streaming: 4)")
    evict_slack: int | None = Field(
        None, ge=1, le=1_000_000, description="a cache over its budget is evicted down to budget - slack, so "
                                              "eviction runs once per slack steps; unset: budget // 16, 1: every step")
    position_rolling: CliImplicitFlag[bool] = Field(
        True, description="give cached keys the positions of their slots, so RoPE never sees a position "
                          "beyond the budget (--no-position-rolling keeps the original positions)")
    recall_budget: int | None = Field(
        None, ge=0, le=1_000_000, description="slots per layer/KV head of each conversation's recall window: copies of "
                                              "the archived (evicted) blocks its latest queries point at, chosen by "
                                              "every prefill chunk and decode steps (--recall-burst, --recall-interval), held on "
                                              "top of --kv-budget; a multiple of --recall-block; 0: evicted tokens are "
                                              "dropped; unset: 128 with an evicting policy and position rolling, else 0")
    recall_block: int = Field(8, ge=1, le=4096, description="tokens per archived block, the unit of recall")
    recall_digest: Literal["centre", "mean", "minmax"] = Field(
        "centre", description="what ranks the archived blocks before their keys are read: centre, their keys' "
                              "mean; mean, that mean -/+ the keys' mean deviation (ArkVale); minmax, their min "
                              "and max (Quest)")
    recall_positions: Literal["text", "rank"] | None = Field(
        None, description="where RoPE reads the held keys of a conversation with a recall window: text, own keys "
                          "at their slots and recalled ones between them; rank, every held key at its rank in "
                          "the text (a recalled phrase one position a word) in every prefill pass and a reply's "
                          "first --recall-rank-steps; unset: rank on the CPU, text on a GPU (on an H200 ranks "
                          "cost the captured step ~2 ms at batch 1, one stream 148 against 225 tok/s)")
    recall_rank_steps: int = Field(
        32, ge=0, le=1_000_000, description="with --recall-positions rank: a reply's first decode steps that read "
                                            "the held keys at their ranks, then the text layout until the next "
                                            "prompt (every prefill pass reads ranks; 1000000: every step)")
    recall_archive: int = Field(
        24576, ge=1, le=10_000_000, description="most evicted tokens per layer/KV head a conversation archives in "
                                                "host memory (at least --recall-budget); the oldest go first")
    recall_probe: int = Field(
        64, ge=1, le=65536, description="last tokens of a turn's prompt, fed as chunks of their own so that their "
                                        "queries (the question) alone choose the recall window the reply starts with")
    recall_probe_break: bool = Field(
        False, description="the probe starts after the last blank line within those tokens where there is one, so "
                           "that a question set apart from a pasted document probes alone (finds more codes said "
                           "once, fewer names and listed secrets)")
    recall_reread: int = Field(
        96, ge=0, le=65536, description="most tokens of a long prompt fed again right after its question (before "
                                        "the template's end of the user's turn): the passages a greedy look at the "
                                        "reply's first --recall-reread-look tokens over the whole conversation "
                                        "(--recall-reread-dense) attends to, so that a fact said once is read next "
                                        "to the question; only for a turn longer than --kv-budget (0: off)")
    recall_reread_look: int = Field(
        16, ge=2, le=4096, description="decode steps of a re-read's look (--recall-reread); its first step is what "
                                       "the others are measured against")
    recall_reread_dense: int = Field(
        8192, ge=0, le=1 << 20, description="most tokens of a conversation (the newest) that a re-read's look attends "
                                            "to at once, each at its place in the text, in a transient cache of its "
                                            "own (host memory on the CPU: ~70 KB a token on the default model); 0: "
                                            "the look reads through the recall window as a reply does")
    recall_burst: int = Field(
        16, ge=0, le=65536, description="decode steps at the start of each reply that all choose the recall window "
                                        "by their queries (where an answer about the prompt starts)")
    recall_interval: int = Field(
        1, ge=1, le=4096, description="decode steps between two choices of a conversation's recall window by its "
                                      "latest queries after --recall-burst, when it decodes alone; with n "
                                      "conversations decoding, n times this (at most --recall-interval-max), so "
                                      "choosing costs about the same share of a step at any batch (every prefill "
                                      "chunk chooses with its own)")
    recall_interval_max: int = Field(
        32, ge=1, le=4096, description="most decode steps between two choices of a conversation's recall window, "
                                       "however many conversations decode (at or below --recall-interval: the "
                                       "interval does not grow)")
    recall_voters: int = Field(
        2, ge=0, le=4096, description="layers (evenly spaced) whose attention votes in the choices of the recall window "
                                      "after --recall-burst: only their archived keys are read, and every layer takes "
                                      "its tokens by their votes (0: all layers)")
    recall_sweep: int = Field(
        512, ge=0, le=10_000_000, description="a reply's decode choices after its first rank by their digests only the "
                                              "archived blocks each head chose last time, those its reply's first "
                                              "choice took and the next this many in turn, so a choice's ranking stops "
                                              "growing with the archive past ~(512 + this) blocks (0: every block, "
                                              "every choice)")
    recall_choices: int | None = Field(
        None, ge=1, le=65536, description="most conversations that choose their recall window by their latest queries "
                                          "before one decode step; the others wait for the next (a reply's first choice, "
                                          "by its question, goes first); unset: all on the CPU, 1 on a GPU, where a "
                                          "choice runs on the host and costs more than a batched step (RESULTS.md)")
    recall_margin: float = Field(
        1.0, ge=0.0, le=100.0, description="a decode step's choice after --recall-burst ranks the tokens a head's recall "
                                           "window holds with their votes times 1 + this, so that fewer slots are "
                                           "rewritten per choice (0: by the votes alone)")
    recall_overlap: bool | None = Field(
        None, description="make the due choices of the recall window (all but a reply's first) on the host while the "
                          "device runs the decode step, by the queries of the step before it (a window one step "
                          "older); unset: on a GPU, not on the CPU, whose step runs on the same cores")
    recall_queries: int = Field(
        32, ge=1, le=65536, description="most queries per head of a chunk of a prompt's body that choose its recall "
                                        "window, evenly spaced, the chunk's last among them; the question's chunks "
                                        "(the prompt's last --recall-probe tokens) choose by all of theirs; a number "
                                        "as large as the chunk: all of them")
    recall_ahead: CliImplicitFlag[bool] = Field(
        False, description="a chunk of a prompt's body takes, before its pass, the window its previous chunk's queries "
                           "chose, all layers in one choice (one per chunk, not one per layer: a 2k prompt's prefill 1.23x "
                           "recall-off against 1.41x with 16 queries alone), instead of choosing with its own queries "
                           "layer by layer; the question's tail always chooses with its own (off: a pass key at depth 50% of a 1k prompt 20/20 against 17/20)")
    max_archive_bytes: int = Field(
        8 << 30, ge=0, le=1 << 50, description="most host memory the archives of idle conversations take in all; "
                                                "beyond, the least recently used lose theirs (they go on without "
                                                "recalling what was evicted before)")

    # ----- engine -----------------------------------------------------------------------------------
    max_batch_size: int = Field(16, ge=1, le=1024, description="sequences decoded together in one step")
    max_queue: int = Field(64, ge=1, le=100_000, description="requests waiting or running; more get 429")
    max_sessions: int = Field(256, ge=1, le=1_000_000, description="conversations kept; least recently used dropped")
    session_ttl: float = Field(1800.0, gt=0, description="seconds an idle conversation is kept")
    state_dir: str = Field(
        default_factory=default_state_dir,
        description="directory where conversations persist: every completed turn's transcript (SQLite) and, at a "
                    "graceful shutdown, each idle conversation's KV cache, so a restarted server resumes them; "
                    "'' keeps nothing on disk (default: $XDG_DATA_HOME/h2o-chat or ~/.local/share/h2o-chat)")
    max_state_bytes: int = Field(
        8 << 30, ge=0, le=1 << 50, description="most bytes of transcripts and snapshots kept in --state-dir; "
                                                "beyond, the oldest snapshots go first, then the oldest transcripts")
    max_prompt_tokens: int = Field(
        32768, ge=1, le=10_000_000, description="most prompt tokens one request may prefill; more get 400")
    prefill_chunk: int | None = Field(
        None, ge=1, le=65536, description="longest piece of one prompt fed in one pass (bounds prefill memory); unset: "
                                          "--kv-budget // 2 with recall (every chunk chooses its window: a pass key at "
                                          "depths 50% and 90% of a 5k-token message was found 10/10 each in chunks "
                                          "of 128; in chunks of 256, 2/10 at depth 90%), else 256")
    prefill_tokens: int = Field(
        512, ge=1, le=1_000_000, description="prompt tokens prefilled per engine iteration, over several waiting "
                                             "requests (one chunk each), between decode steps")
    enforce_eager: CliImplicitFlag[bool] = Field(
        False, description="decode on the transformers path instead of the fast fixed-shape step (CUDA graphs on a GPU)")
    exact: CliImplicitFlag[bool] = Field(
        False, description="on the CPU, multiply the GGUF blocks by the fp32 activations as they are (the dense model's "
                           "values), instead of quantizing them per 32-block to int8 for integer dot products (faster)")
    default_max_tokens: int = Field(512, ge=1, le=1_000_000, description="reply tokens when a request sets none")
    max_tokens_limit: int = Field(
        4096, ge=1, le=1_000_000, description="most reply tokens a request may ask for; a larger max_tokens gets 400 "
                                        "(the default is capped to it)")

    @field_validator("api_key", "allowed_origins", mode="before")
    @classmethod
    def _split_keys(cls, keys):
        """H2O_API_KEY=k1,k2, H2O_ALLOWED_ORIGINS=a,b (plain text rather than JSON, so `docker run -e ...` just
        works)."""
        return [k.strip() for k in keys.split(",") if k.strip()] if isinstance(keys, str) else keys

    @property
    def recall(self) -> int:
        """--recall-budget, or its default: on where recall applies (an evicting policy with rolling)."""
        if self.recall_budget is not None:
            return self.recall_budget
        return DEFAULT_RECALL if self.policy != "full" and self.position_rolling else 0

    @property
    def chunk(self) -> int:
        """--prefill-chunk, or its default: half the budget with recall, else 256."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return max(1, self.kv_budget // 2) if self.recall else DEFAULT_PREFILL_CHUNK

    def cache_config(self, device: str = "cpu") -> CacheConfig:
        """The caches' settings for a model on `device` (the type: "cpu", "cuda"), which sets
        --recall-choices' default."""
        choices = self.recall_choices if self.recall_choices is not None else (1 if device == "cuda" else None)
        positions = self.recall_positions or ("text" if device == "cuda" else "rank")
        return CacheConfig(policy=self.policy, budget=self.kv_budget, heavy_ratio=self.heavy_ratio,
                           sink_tokens=self.sink_tokens, evict_slack=self.evict_slack,
                           position_rolling=self.position_rolling, prefill_chunk=self.chunk,
                           recall_budget=self.recall, recall_block=self.recall_block, recall_digest=self.recall_digest,
                           recall_positions=positions, recall_rank_steps=self.recall_rank_steps,
                           recall_archive=self.recall_archive, recall_probe=self.recall_probe,
                           recall_probe_break=self.recall_probe_break,
                           recall_burst=self.recall_burst, recall_interval=self.recall_interval,
                           recall_interval_max=self.recall_interval_max, recall_voters=self.recall_voters,
                           recall_queries=self.recall_queries, recall_ahead=self.recall_ahead, recall_choices=choices,
                           recall_overlap=self.recall_overlap, recall_margin=self.recall_margin,
                           recall_sweep=self.recall_sweep, recall_reread=self.recall_reread,
                           recall_reread_look=self.recall_reread_look, recall_reread_dense=self.recall_reread_dense)

    def engine_config(self, context_window: int | None) -> EngineConfig:
        """context_window: the model's max_position_embeddings, the limit of the `full` policy."""
        return EngineConfig(max_batch_size=self.max_batch_size, max_queue=self.max_queue,
                            max_sessions=self.max_sessions, session_ttl=self.session_ttl,
                            max_prompt_tokens=self.max_prompt_tokens, prefill_tokens=self.prefill_tokens,
                            enforce_eager=self.enforce_eager, exact=self.exact, context_window=context_window,
                            max_archive_bytes=self.max_archive_bytes,
                            state_dir=self.state_dir or None, max_state_bytes=self.max_state_bytes)

    def torch_threads(self) -> int:
        """Cores this process may run on (a container's CPU set, not the host's), unless --threads says."""
        if self.threads:
            return self.threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
