"""training.throughput_noise_target: the trainer stops cleanly once its steady-state tokens/s
median is known within the target, the profiled steps are marked and left out, and the records
carry real and processed tokens/s and both MFU figures."""

import json

from torchtitan_ablate import train
from torchtitan_ablate.components.observability.metrics import MIN_NOISE_SAMPLES
from torchtitan_ablate.config import load_config


def test_noise_target_stops_after_enough_steady_steps(tmp_path, caplog):
    config = load_config(
        ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
         "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--training.steps", "200", "--training.throughput_warmup_steps", "2",
         "--training.throughput_noise_target", "0.99", "--metrics.comm_profile", "true",
         "--training.packing", "padding"]
    )  # fmt: skip
    with caplog.at_level("INFO", logger="torchtitan_ablate"):
        records = train.main(config)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in records]
    profiled = [r["step"] for r in rows if r.get("profiled")]
    assert profiled == [3, 4, 5]  # the 3 steps after the warm-up
    # Stops at the first step with 10 steady, unprofiled samples (or soon after, should a slow
    # CPU step make the interval wider than 99%), far before the 200-step budget.
    first_possible = 2 + len(profiled) + MIN_NOISE_SAMPLES
    assert first_possible <= rows[-1]["step"] < 60
    assert "training.throughput_noise_target" in caplog.text
    # Padding rows: the trained tokens are fewer than the processed ones.
    assert all(r["tps"] <= r["tps_processed"] for r in rows)
    assert sum(r["tps"] for r in rows) < 0.95 * sum(r["tps_processed"] for r in rows)
    assert all({"tflops_doc", "mfu_doc"} <= set(r) for r in rows)
