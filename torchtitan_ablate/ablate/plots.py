"""Report plots (matplotlib, optional extra `plots`): loss curves, throughput, memory measured vs
predicted, and tokens/s against the batch per optimizer step for batch-size sweeps."""

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return name


def loss_plot(plt, rows: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, row in enumerate(rows):
        color = f"C{i % 10}"
        for j, (_seed, curve) in enumerate(sorted((row.get("curves") or {}).items())):
            steps, losses = zip(*curve)
            label = row["variant"] if j == 0 else None
            ax.plot(steps, losses, styles[j % 4], color=color, label=label, marker=".")
    ax.set(xlabel="step", ylabel="training loss", title="Loss (one line style per seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "loss.png")


def _bars(ax, names: list[str], values: list, offset: float, width: float, **kw) -> None:
    xs = [i + offset for i in range(len(names))]
    ax.bar(xs, [v or 0 for v in values], width, **kw)
    for x, v in zip(xs, values):
        if v is None:
            ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)


def throughput_plot(plt, rows: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4.5))
    names = [r["variant"] for r in rows]
    tps = [r["tps_median"] for r in rows]
    err = [(r["tps_noise_pct"] or 0) / 100 * (r["tps_median"] or 0) for r in rows]
    _bars(ax, names, tps, 0, 0.6, yerr=err, capsize=4, color="C0")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="tokens/s per GPU (median)", title="Throughput (bars: run-to-run noise)")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out, "throughput.png")


def memory_plot(plt, rows: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4.5))
    names = [r["variant"] for r in rows]
    _bars(ax, names, [r["memory_measured_gib"] for r in rows], -0.2, 0.4, label="measured")
    _bars(ax, names, [r["memory_predicted_gib"] for r in rows], 0.2, 0.4, label="predicted")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="peak memory per GPU (GiB)", title="Peak memory: measured vs predicted")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out, "memory.png")


def tokens_vs_batch_plot(plt, rows: list[dict], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["tps_median"] is not None and r["tokens_per_step"]:
            groups.setdefault(r["group"], []).append(r)
    for group, members in groups.items():
        members.sort(key=lambda r: (r["tokens_per_step"], r["grad_accum"]))
        xs = [r["tokens_per_step"] for r in members]
        ax.plot(xs, [r["tps_median"] for r in members], marker="o", label=group)
        for r in members:
            note = f"gbs{r['global_batch_size']} ga{r['grad_accum']}"
            ax.annotate(note, (r["tokens_per_step"], r["tps_median"]), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens per optimizer step (global batch x seq_len)")
    ax.set(
        ylabel="tokens/s per GPU (median)",
        title="Throughput vs batch (gbs: sequences/step, ga: accumulation)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "tokens_vs_batch.png")


def make_plots(rows: list[dict], out: Path) -> list[str]:
    """Writes the plots into out; returns their file names ([] without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    names = [loss_plot(plt, rows, out), throughput_plot(plt, rows, out)]
    names.append(memory_plot(plt, rows, out))
    batches = {(r["tokens_per_step"], r["grad_accum"]) for r in rows if r["tokens_per_step"]}
    if len(batches) > 1:  # a batch-size or accumulation sweep
        names.append(tokens_vs_batch_plot(plt, rows, out))
    plt.close("all")
    return names
