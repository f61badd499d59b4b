"""Does a long conversation's time per token stay flat? Blocks of turns from the MT-Bench demo's CSVs.

A reply's time per token is 1000 / `decode_tokens_per_s`, counted where the reply has at least
`min_tokens` tokens (the rate of a 4-token reply is two or three gaps between frames). Each block of
`block` turns gives its median, and its growth over the first block: median(block) / median(first),
with a 95% percentile-bootstrap interval that draws each block's turns again.

Against a reference server (`reference`, e.g. the same model without recall), each turn's time is
divided by the reference's at the same turn, and the blocks take the medians of those ratios. Played
turn by turn (`mtbench_demo --interleave`), the two servers meet the same phases of a shared or
throttled machine, so that what the ratio's growth shows is the server's, not the machine's: absolute
times on this project's VMs drift by 10-30% over a run of minutes.
"""

from __future__ import annotations

import random
import statistics

MIN_TOKENS = 32
RESAMPLES = 2000


def turn_ms(rows: list[dict], min_tokens: int = MIN_TOKENS) -> dict[int, float]:
    """turn -> ms per decoded token, for the turns that answered with at least min_tokens tokens."""
    out = {}
    for r in rows:
        if r.get("error") or not r.get("decode_tokens_per_s") or int(r.get("completion_tokens") or 0) < min_tokens:
            continue
        rate = float(r["decode_tokens_per_s"])
        if rate > 0:
            out[int(r["turn"])] = 1000 / rate
    return out


def growth(first: list[float], later: list[float], resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """median(later) / median(first), and its 95% percentile-bootstrap interval (each list drawn again)."""
    rng = random.Random(seed)
    value = statistics.median(later) / statistics.median(first)
    draws = sorted(statistics.median(rng.choices(later, k=len(later))) / statistics.median(rng.choices(first, k=len(first)))
                   for _ in range(resamples))
    return value, draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def blocks(series: dict[int, float], block: int) -> dict[int, list[float]]:
    """first turn of each block -> the series' values in it (turns numbered from 1)."""
    out: dict[int, list[float]] = {}
    for turn in sorted(series):
        out.setdefault((turn - 1) // block * block + 1, []).append(series[turn])
    return out


def table(runs: dict[str, list[dict]], reference: str | None = None, block: int = 20,
          min_tokens: int = MIN_TOKENS) -> str:
    """One line per block of turns: each run's median ms per token and its growth over the first block,
    and with `reference` each other run's median ratio to it turn by turn, with that ratio's growth."""
    series = {label: turn_ms(rows, min_tokens) for label, rows in runs.items()}
    columns: list[tuple[str, dict[int, float], str]] = [(label, s, "ms") for label, s in series.items()]
    if reference is not None:
        if reference not in series:
            raise ValueError(f"no run labelled {reference!r} to compare with (runs: {', '.join(series)})")
        base = series[reference]
        columns += [(f"{label} / {reference}", {t: v / base[t] for t, v in s.items() if t in base}, "ratio")
                    for label, s in series.items() if label != reference]
    head = ["turns"] + [f"{name} ({unit}, n, growth [95% CI])" for name, _, unit in columns]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    split = [blocks(s, block) for _, s, _ in columns]
    starts = sorted({start for b in split for start in b})
    for start in starts:
        cells = [f"{start}-{start + block - 1}"]
        for b in split:
            values, first = b.get(start), b.get(min(b)) if b else None
            if not values:
                cells.append("-")
                continue
            cell = f"{statistics.median(values):.3f}, {len(values)}"
            if start != min(b) and len(first) > 1 and len(values) > 1:
                g, low, high = growth(first, values)
                cell += f", {g:.3f} [{low:.3f}, {high:.3f}]"
            cells.append(cell)
        lines.append(" | ".join(cells))
    return "\n".join(lines)
