"""The report's pipeline-parallel columns, from the "pipeline" entry of the runs'
comm_profile.json (metrics.comm_profile under PP; docs/ablation.md):

- bubble measured % (mean / max over pp ranks): per pipeline rank, the share of the profiled
  steps in which its device ran no compute (1 - compute share, averaged over the ranks of that
  pipeline rank); the mean and the max over the pipeline ranks, each averaged over seeds;
- bubble theoretical %: the schedule's ideal bubble (pipeline_parallel.theoretical_bubble);
- peak mem per pp rank GiB: each pipeline rank's peak active memory over the profiled steps, the
  max over seeds (CUDA only).
"""

import statistics
from typing import Any

# Under the table of a study with pipelined runs.
NOTE = (
    "Bubble (pipeline parallel): per pipeline rank, the share of the profiled steps in which "
    "its device ran no compute (P2P waits, exposed collectives, idle; on CPU also Python "
    "between ops), mean / max over the pipeline ranks; theoretical: the schedule's ideal with "
    "equal stage times (docs/ablation.md)."
)
COLUMNS = ["bubble_measured_pct", "bubble_measured_max_pct", "bubble_theoretical_pct",
           "stage_peak_gib"]  # fmt: skip


def fill(row: dict[str, Any], profiles: list[dict]) -> None:
    """Sets the columns of one variant from its seeds' comm_profile.json (None without PP)."""
    entries = [p["pipeline"] for p in profiles if p.get("pipeline")]
    for column, key in (("bubble_measured_pct", "measured_bubble_mean"),
                        ("bubble_measured_max_pct", "measured_bubble_max")):  # fmt: skip
        values = [e[key] for e in entries]
        row[column] = 100 * statistics.fmean(values) if values else None
    theory = [e["theoretical_bubble"] for e in entries if e["theoretical_bubble"] is not None]
    row["bubble_theoretical_pct"] = 100 * theory[0] if theory else None
    peaks: dict[int, float] = {}
    for e in entries:
        for stage in e["per_pp_rank"]:
            if stage["peak_active_gib"] is not None:
                pp_rank = stage["pp_rank"]
                peaks[pp_rank] = max(peaks.get(pp_rank, 0.0), stage["peak_active_gib"])
    row["stage_peak_gib"] = [peaks[r] for r in sorted(peaks)] or None


def header(rows: list[dict]) -> tuple[str, str]:
    """The markdown table's extra header and separator ("", "" when no run is pipelined)."""
    if not any(r.get("bubble_measured_pct") is not None for r in rows):
        return "", ""
    head = " bubble measured % (mean / max over pp ranks) | bubble theoretical % |"
    sep = "---|---|"
    if any(r.get("stage_peak_gib") for r in rows):
        head += " peak mem per pp rank GiB |"
        sep += "---|"
    return head, sep


def cells(row: dict, rows: list[dict]) -> str:
    """One row's cells under header(rows)."""
    if not header(rows)[0]:
        return ""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f}"

    measured = "n/a"
    if row.get("bubble_measured_pct") is not None:
        measured = f"{pct(row['bubble_measured_pct'])} / {pct(row['bubble_measured_max_pct'])}"
    line = f" {measured} | {pct(row.get('bubble_theoretical_pct'))} |"
    if any(r.get("stage_peak_gib") for r in rows):
        peaks = row.get("stage_peak_gib")
        line += f" {' / '.join(f'{p:.2f}' for p in peaks) if peaks else 'n/a'} |"
    return line
