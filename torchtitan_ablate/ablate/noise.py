"""The mark of a throughput figure measured over too few steps to know its noise, shared by the
report's table, verdicts and plots (report.py defines the noise)."""


def noise_unknown(row: dict) -> str | None:
    """The mark of a tokens/s median too few steps measured to know its noise (fewer than
    MIN_NOISE_SAMPLES steady steps and one seed), e.g. "n=1 step: noise unknown"; None for a
    figure whose noise is known, or no figure."""
    if row.get("tps_median") is None or row.get("tps_noise_pct") is not None:
        return None
    n = row.get("tps_steps") or 0
    return f"n={n} step{'' if n == 1 else 's'}: noise unknown"
