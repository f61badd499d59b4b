"""Per-turn CSVs of the MT-Bench demo, and their plot: latency and memory, one line per server mode."""

from __future__ import annotations

import csv
from pathlib import Path

FIELDS = ["label", "turn", "question_id", "category", "question_turn", "ttft_s", "decode_tokens_per_s",
          "turn_s", "prompt_tokens", "completion_tokens", "cached_tokens", "conversation_tokens",
          "kv_resident_tokens", "repeats_previous", "error"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _series(rows: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    ok = [r for r in rows if not r["error"] and r[key] not in ("", None)]
    return [int(r["turn"]) for r in ok], [float(r[key]) * scale for r in ok]


def plot_runs(runs: dict[str, list[dict]], path: Path) -> None:
    """runs: label -> CSV rows. A failed turn is a dotted vertical line in its run's colour, labelled."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works in a container or over ssh with no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_ttft, ax_tok, ax_mem) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i}"
        ax_ttft.plot(*_series(rows, "ttft_s"), color=color, label=label)
        turns, tps = _series(rows, "decode_tokens_per_s")
        ax_tok.plot(turns, [1000 / t if t > 0 else float("nan") for t in tps], color=color, label=label)
        ax_mem.plot(*_series(rows, "kv_resident_tokens"), color=color, label=f"{label}: resident KV cache")
        ax_mem.plot(*_series(rows, "conversation_tokens"), color=color, linestyle="--", linewidth=0.8,
                    label=f"{label}: conversation length")
        for r in (r for r in rows if r["error"]):
            for ax in (ax_ttft, ax_tok, ax_mem):
                ax.axvline(int(r["turn"]), color=color, linestyle=":", linewidth=1.5)
            ax_ttft.annotate(f"{label}: turn {r['turn']} failed\n{r['error'][:60]}", (int(r["turn"]), 0.95),
                             xycoords=("data", "axes fraction"), color=color, fontsize=8, ha="right", va="top")
    ax_ttft.set_ylabel("time to first token (s)")
    ax_tok.set_ylabel("decode time per token (ms)")
    ax_mem.set_ylabel("tokens per layer and KV head")
    ax_mem.set_xlabel("user turn in one conversation (MT-Bench: 80 questions x 2 turns)")
    ax_ttft.set_title("One long MT-Bench conversation: per-turn latency and KV cache memory")
    ax_mem.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_ttft, ax_tok, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
