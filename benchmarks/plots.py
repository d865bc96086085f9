"""PNG plots of a results dict (the JSON `run.py` writes)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, ax, path: Path, **legend) -> None:
    """Grid, legend, layout, PNG file; then frees the figure."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLORS = {"mokv-paged": "tab:blue", "mokv-paged-nolock": "tab:cyan", "mokv-continuous": "tab:green", "max-paged": "tab:red"}


def host_cost_vs_batch(sweep: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, rows in sweep.items():
        bs = sorted(int(b) for b in rows)
        rows = {int(k): v for k, v in rows.items()}
        ax.plot(bs, [rows[b]["us_per_request_step"] for b in bs], "o-", color=COLORS.get(m),
                label=f"{m} (all-in)")
        ax.plot(bs, [rows[b]["bookkeeping_us"] for b in bs], "x--", color=COLORS.get(m),
                alpha=0.6, label=f"{m} (bookkeeping)")
    ax.set(xscale="log", yscale="log", xlabel="batch size (decode requests)",
           ylabel="host µs per request-step (median)",
           title="KV manager host cost per scheduled request-step")
    _save(fig, ax, path, fontsize=7)


def hit_rate_vs_budget(sweep: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, rows in sweep["managers"].items():
        ax.plot(sweep["budgets"], [r["hit_rate"] for r in rows], "o-", color=COLORS.get(m), label=m)
    ax.axhline(sweep["bound"], color="gray", ls=":", label="infinite-cache bound")
    ax.set(xscale="log", xlabel="page budget (pages of 128 tokens)",
           ylabel="prefix hit rate over prompt tokens", ylim=(0, 1),
           title="Prefix-cache hit rate vs memory budget")
    _save(fig, ax, path, fontsize=8)


def hit_rate_vs_host_pages(replay: dict, path: Path) -> None:
    """bench_host_tier.py's replay: hit rate at one device budget as the host tier grows."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = replay["rows"]
    sizes = [max(r["host_pages"], 1) for r in rows]  # 0 (device only) at the left edge
    ax.plot(sizes, [r["hit_rate"] for r in rows], "o-", color=COLORS["mokv-paged"],
            label=f"mokv-paged, {replay['device_pages']} device pages + host tier")
    ax.axhline(rows[0]["hit_rate"], color=COLORS["mokv-paged"], ls="--", lw=1,
               label="device pages only")
    ax.axhline(replay["bound"], color="gray", ls=":", label="infinite-cache bound")
    ax.set(xscale="log", xlabel="host-tier pages (pages of 128 tokens; 1 = none)",
           ylabel="prefix hit rate over prompt tokens", ylim=(0, 1),
           title="Prefix-cache hit rate vs host-tier size")
    _save(fig, ax, path, fontsize=8)


def decode_bandwidth(attn: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sides = [s for s in COLORS if s in attn.get("sides", {})]
    batches = sorted({r["batch"] for r in attn["decode"]})
    styles = ["o-", "s--", "^-.", "d:"]
    for side in sides:
        for i, b in enumerate(batches):
            rows = [r for r in attn["decode"] if r["batch"] == b and side in r]
            if rows:
                ax.plot([r["context"] for r in rows], [r[side]["GBps"] for r in rows],
                        styles[i % len(styles)], color=COLORS[side], label=f"{side} B={b}")
    copy = attn["copy"]
    ax.axhline(copy["read_2threads_GBps"], color="black", ls="-", lw=1, label="two-thread read")
    ax.axhline(copy["numpy_copy_GBps"], color="gray", ls="--", lw=1, label="numpy copy")
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="K/V bytes read / time (GB/s)",
           title="CPU decode attention bandwidth (32q/8kv heads, d=128, fp32)")
    _save(fig, ax, path, fontsize=6, ncol=2)


def write_all(results: dict, out: Path) -> list[str]:
    """Draws whatever parts `results` holds; returns the files written."""
    written = []
    man = results.get("managers", {})
    if "batch_sweep" in man:
        host_cost_vs_batch(man["batch_sweep"], out / "host_us_vs_batch.png")
        written.append("host_us_vs_batch.png")
    if "budget_sweep" in man:
        hit_rate_vs_budget(man["budget_sweep"], out / "hit_rate_vs_budget.png")
        written.append("hit_rate_vs_budget.png")
    if results.get("attention", {}).get("decode"):
        decode_bandwidth(results["attention"], out / "decode_bandwidth.png")
        written.append("decode_bandwidth.png")
    return written
