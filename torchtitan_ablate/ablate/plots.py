"""Report plots (matplotlib, optional extra `plots`): loss curves against steps (and against
tokens seen when the variants see different tokens per step), throughput, memory measured vs
predicted, tokens/s and memory against the batch per optimizer step for batch-size sweeps, and
the profiled step's breakdown (compute / exposed communication / idle) per variant.

Each `*_figure` function returns the figure unsaved, so tests can read its legends and axes."""

from pathlib import Path

from torchtitan_ablate.ablate.noise import noise_unknown


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


STYLES = ["-", "--", ":", "-."]
TOKENS_LABEL = {
    "logged": "tokens seen (the trainer's count)",
    "derived": "tokens seen = step x global batch x seq_len (padding included)",
}


def loss_figure(plt, rows: list[dict], curves: str = "curves"):
    """Loss per variant (colour) and seed (line style), each with its own legend; curves:
    "curves" (x = step, integer ticks) or "token_curves" (x = tokens seen)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # A seed keeps its line style across variants, also where a variant lost a seed.
    seeds = sorted({seed for row in rows for seed in (row.get(curves) or {})})
    variants = []
    for i, row in enumerate(rows):
        color = f"C{i % 10}"
        for seed, curve in sorted((row.get(curves) or {}).items()):
            xs, losses = zip(*curve)
            ax.plot(xs, losses, STYLES[seeds.index(seed) % 4], color=color, marker=".")
        if row.get(curves):
            variants.append(Line2D([], [], color=color, label=row["variant"]))
    if curves == "curves":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="step", title="Loss")
    else:
        bases = sorted({b for row in rows for b in row.get("token_bases", [])})
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set(xlabel="; ".join(TOKENS_LABEL[b] for b in bases), title="Loss vs tokens seen")
    ax.set(ylabel="training loss")
    ax.grid(alpha=0.3)
    if variants:
        legend = ax.legend(handles=variants, title="variant", fontsize=8, loc="upper right")
        if len(seeds) > 1:
            ax.add_artist(legend)  # a second ax.legend() would replace it
            styles = [Line2D([], [], color="gray", linestyle=STYLES[j % 4], label=f"seed {s}")
                      for j, s in enumerate(seeds)]  # fmt: skip
            ax.legend(handles=styles, title="seed", fontsize=8, loc="lower left")
    return fig


def loss_plot(plt, rows: list[dict], out: Path) -> str:
    return _save(loss_figure(plt, rows), out, "loss.png")


def loss_vs_tokens_plot(plt, rows: list[dict], out: Path) -> str:
    return _save(loss_figure(plt, rows, "token_curves"), out, "loss_vs_tokens.png")


def tokens_differ(rows: list[dict]) -> bool:
    """Whether the variants that ran see different tokens per step or pack differently, so
    loss against steps alone would mislead (packing studies, batch-size sweeps)."""
    ran = [r for r in rows if r.get("token_curves")]
    kinds = {(r["tokens_per_step"], r.get("packing")) for r in ran}
    return len(kinds) > 1


def _bars(ax, names: list[str], values: list, offset: float, width: float, **kw) -> None:
    xs = [i + offset for i in range(len(names))]
    ax.bar(xs, [v or 0 for v in values], width, **kw)
    for x, v in zip(xs, values):
        if v is None:
            ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)


def throughput_figure(plt, rows: list[dict]):
    """Median tokens/s per variant with its noise as error bars; a median whose noise is unknown
    (too few steps) is a hatched grey bar without error bar, labelled "n=K steps: noise
    unknown", never a bar with a zero-width interval."""
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4.5))
    names = [r["variant"] for r in rows]
    for i, r in enumerate(rows):
        unknown = noise_unknown(r)
        if unknown:
            ax.bar(i, r["tps_median"], 0.6, color="0.85", hatch="//", edgecolor="0.4")
            ax.text(i, r["tps_median"], unknown.replace(": ", ":\n"), ha="center",
                    va="bottom", fontsize=7)  # fmt: skip
        else:
            noise = (r["tps_noise_pct"] or 0) / 100 * (r["tps_median"] or 0)
            _bars(ax, [r["variant"]], [r["tps_median"]], i, 0.6, yerr=noise, capsize=4, color="C0")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="tokens/s per GPU (median)", title="Throughput (error bars: its noise)")
    if any(noise_unknown(r) for r in rows):
        hatched = Patch(facecolor="0.85", hatch="//", edgecolor="0.4", label="noise unknown")
        ax.legend(handles=[hatched], fontsize=8, loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    return fig


def throughput_plot(plt, rows: list[dict], out: Path) -> str:
    return _save(throughput_figure(plt, rows), out, "throughput.png")


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
            if noise_unknown(r):
                note += f" ({noise_unknown(r)})"
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


def memory_vs_batch_plot(plt, rows: list[dict], out: Path) -> str:
    """Peak memory per GPU against tokens per optimizer step, measured (solid) and predicted
    (dashed), one colour per group."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["tokens_per_step"]:
            groups.setdefault(r["group"], []).append(r)
    for i, (group, members) in enumerate(groups.items()):
        members.sort(key=lambda r: (r["tokens_per_step"], r["grad_accum"]))
        for key, style, what in (("memory_measured_gib", "-o", "measured"),
                                 ("memory_predicted_gib", "--x", "predicted")):  # fmt: skip
            pts = [(r["tokens_per_step"], r[key]) for r in members if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i % 10}", label=f"{group} {what}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens per optimizer step (global batch x seq_len)")
    ax.set(ylabel="peak memory per GPU (GiB)", title="Memory vs batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "memory_vs_batch.png")


BREAKDOWN = (  # (label, colour): the parts of a step that add up to 100%
    ("compute", "C0"),
    ("exposed communication", "C3"),
    ("idle: data loading", "C2"),
    ("idle: other (host-bound)", "C7"),
)


def step_breakdown(row: dict) -> list[float] | None:
    """The profiled step of a variant in % (BREAKDOWN's order): compute, exposed collectives,
    and the idle rest split into waiting for data (at most the idle time) and other host time;
    None without a profile."""
    if row.get("compute_pct") is None or row.get("idle_pct") is None:
        return None
    idle = row["idle_pct"]
    data = min(row.get("data_pct") or 0.0, idle)
    return [row["compute_pct"], row["exposed_comm_pct"] or 0.0, data, idle - data]


def breakdown_figure(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4.5))
    names = [r["variant"] for r in rows]
    parts = [step_breakdown(r) or [0.0] * len(BREAKDOWN) for r in rows]
    bottom = [0.0] * len(rows)
    for j, (label, color) in enumerate(BREAKDOWN):
        heights = [p[j] for p in parts]
        ax.bar(range(len(rows)), heights, 0.6, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, r in enumerate(rows):
        if step_breakdown(r) is None:
            ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="% of step wall time (profiled steps)", ylim=(0, 105))
    ax.set(title="Where the step goes (compute / exposed comm / idle)")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def breakdown_plot(plt, rows: list[dict], out: Path) -> str:
    return _save(breakdown_figure(plt, rows), out, "step_breakdown.png")


def make_plots(rows: list[dict], out: Path) -> list[str]:
    """Writes the plots into out; returns their file names ([] without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    names = [loss_plot(plt, rows, out)]
    if tokens_differ(rows):
        names.append(loss_vs_tokens_plot(plt, rows, out))
    names.append(throughput_plot(plt, rows, out))
    names.append(memory_plot(plt, rows, out))
    batches = {(r["tokens_per_step"], r["grad_accum"]) for r in rows if r["tokens_per_step"]}
    if len(batches) > 1:  # a batch-size or accumulation sweep
        names.append(tokens_vs_batch_plot(plt, rows, out))
        if any(r["memory_measured_gib"] or r["memory_predicted_gib"] for r in rows):
            names.append(memory_vs_batch_plot(plt, rows, out))
    if any(step_breakdown(r) for r in rows):
        names.append(breakdown_plot(plt, rows, out))
    plt.close("all")
    return names
