"""Per-step metrics: one console line, one JSON object per line in metrics.jsonl, TensorBoard
and Weights & Biases (trackers.py).

Per GPU, per second of the log window (docs/performance.md):
- tps: trained tokens, the tokens the loss counts (padding and masked prompts excluded);
  tps_processed: every input token, padding included.
- tflops / mfu (conventional, as published figures): 6 * active non-embedding parameters
  (output included) + 12 * layers * heads * head_dim * seq_len per processed token, i.e.
  attention over the whole row.
- tflops_doc / mfu_doc (the work done): the same 6 * parameters per processed token, plus
  12 * layers * heads * head_dim per (query, key) pair the causal document mask keeps:
  n (n + 1) / 2 pairs per document of n tokens, from each batch's document_ids.
MFU divides achieved FLOP/s by the device peak.
"""

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from typing import Any

import torch

from torchtitan_ablate.components.observability.metrics_file import (
    end_with_a_whole_row,
    keep_rows_up_to,
    move_aside,
)
from torchtitan_ablate.components.observability.trackers import WandbTracker
from torchtitan_ablate.config.job_config import Metrics as MetricsConfig

logger = logging.getLogger("torchtitan_ablate")

MEMORY_KEYS = ("memory_max_active_gib", "memory_max_reserved_gib", "memory_max_reserved_pct")

# Recent step times the ETA takes the median of: long enough to ignore a checkpoint save.
ETA_WINDOW = 20

# Dense bf16 peak TFLOP/s by device-name substring (first match wins).
PEAK_TFLOPS = [("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0)]


def device_peak_tflops(device: torch.device, override: float = -1.0) -> float | None:
    """The device's bf16 peak, or None when unknown (CPU): MFU is then null in metrics.jsonl
    and n/a on the console."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def attention_pairs(document_ids_BS: torch.Tensor | None, seq_len: int, batch: int) -> int:
    """(query, key) pairs a causal attention restricted to documents computes: sum over the
    row segments of n (n + 1) / 2. Computed on the host batch (no device sync); rows without
    document ids are one document each."""
    if document_ids_BS is None:
        return batch * seq_len * (seq_len + 1) // 2
    ids = document_ids_BS.reshape(-1, document_ids_BS.shape[-1])
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    idx = starts.flatten().nonzero().squeeze(1)
    lengths = torch.diff(idx, append=idx.new_tensor([ids.numel()]))
    return int((lengths * (lengths + 1) // 2).sum())


# Fewest samples the confidence interval of a median is computed from (n = 10: min to max).
MIN_NOISE_SAMPLES = 10


def median_noise(values: list[float]) -> float | None:
    """Half-width of the distribution-free 95% confidence interval of the median, relative to
    the median: order statistics r and n + 1 - r with r = floor((n - 1.96 sqrt(n)) / 2) (the
    binomial(n, 1/2) interval), no assumption on the distribution, robust to slow outlier
    steps. None below MIN_NOISE_SAMPLES values or for a non-positive median."""
    n = len(values)
    if n < MIN_NOISE_SAMPLES:
        return None
    xs = sorted(values)
    med = statistics.median(xs)
    if med <= 0:
        return None
    r = max(int((n - 1.96 * math.sqrt(n)) / 2), 1)
    return (xs[n - r] - xs[r - 1]) / 2 / med


def steady_values(records: list[dict], warmup: int, key: str = "tps") -> list[float]:
    """`key` of the records after step `warmup`, leaving out the profiled ones (slower by the
    profiler's overhead)."""
    return [r[key] for r in records if r["step"] > warmup and not r.get("profiled")]


class DeviceMemoryMonitor:
    """Peak active/reserved memory since the last reset, in GiB and % of the device; None
    (null in metrics.jsonl, n/a on the console) where the device keeps no statistics (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity_gib = None
        if device.type == "cuda":
            self.capacity_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
            torch.cuda.reset_peak_memory_stats(device)

    def read_and_reset(self) -> dict[str, float | None]:
        if self.device.type != "cuda":
            return dict.fromkeys(MEMORY_KEYS)
        stats = torch.cuda.memory_stats(self.device)
        active = stats.get("active_bytes.all.peak", 0) / 2**30
        reserved = stats.get("reserved_bytes.all.peak", 0) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return {
            "memory_max_active_gib": active,
            "memory_max_reserved_gib": reserved,
            "memory_max_reserved_pct": 100.0 * reserved / self.capacity_gib,
        }


class MetricsLogger:
    """Accumulates tokens and data-loading time between log steps and writes the record
    (`open` first, once the run knows its first step). `run_config` (the resolved config as a
    dict) goes to Weights & Biases when metrics.enable_wandb; only the writer (rank 0) logs."""

    def __init__(
        self,
        config: MetricsConfig,
        dump_folder: str,
        device: torch.device,
        flops_per_token: float,
        is_writer: bool,
        run_config: dict[str, Any] | None = None,
        dense_flops_per_token: float | None = None,
        attention_flops_per_pair: float = 0.0,
    ) -> None:
        """flops_per_token: the conventional figure; dense_flops_per_token (6 * parameters,
        default flops_per_token) and attention_flops_per_pair (12 * layers * heads * head_dim)
        give the work-done figure from the attention pairs add_tokens counts."""
        self.config = config
        self.flops_per_token = flops_per_token
        self.dense_flops_per_token = (
            flops_per_token if dense_flops_per_token is None else dense_flops_per_token
        )
        self.attention_flops_per_pair = attention_flops_per_pair
        self.peak_tflops = device_peak_tflops(device, config.peak_tflops)
        self.memory = DeviceMemoryMonitor(device)
        self.is_writer = is_writer
        self.dump_folder = dump_folder
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self.jsonl = None
        self.tb = None
        self.wandb = None
        self.step_times: deque[float] = deque(maxlen=ETA_WINDOW)
        self.last_record: dict[str, Any] | None = None
        self.last_step = 0
        self.launch_start = self.step_end = time.perf_counter()  # open() sets them again
        if is_writer:
            os.makedirs(dump_folder, exist_ok=True)
            if config.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(dump_folder, config.save_tb_folder))
            if config.enable_wandb:  # here, not in open(): a login error shows before the model
                self.wandb = WandbTracker(config, dump_folder, run_config or {})
        self._reset_window()

    def open(self, resumed_step: int, last_step: int = 0) -> None:
        """Opens metrics.jsonl once the run knows where it starts. A resumed run keeps the rows
        up to its checkpoint's step (the later ones are trained again) and appends; a new run
        never appends to an earlier run's rows: their file is moved aside, as torchtitan gives
        each launch its own TensorBoard folder. last_step: the run's last step, for `k/N` and
        the ETA (0: unknown)."""
        self.last_step = last_step
        self.launch_start = self.step_end = time.perf_counter()
        if not self.is_writer:
            return
        if os.path.isfile(self.path) and os.path.getsize(self.path) > 0:
            if resumed_step > 0:
                fixed = end_with_a_whole_row(self.path)  # else this run's first row joins it
                if fixed:
                    logger.warning(f"{self.path}: {fixed}")
                dropped = keep_rows_up_to(self.path, resumed_step)
                if dropped:
                    logger.info(
                        f"{self.path}: dropped {dropped} rows after step {resumed_step}, "
                        "the checkpoint this run resumes from"
                    )
            else:
                old = move_aside(self.path)
                logger.warning(f"{self.path} of an earlier run moved to {old}: a new run")
        self.jsonl = open(self.path, "a")

    def _reset_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.window_trained = 0.0
        self.window_pairs = 0.0
        self.window_data_time = 0.0
        self.window_profiled = False

    def add_tokens(
        self,
        num_tokens: int,
        data_time: float,
        attention_pairs: float,
        profiled: bool = False,
    ) -> None:
        """One step on this GPU: tokens processed (incl. padding), seconds spent waiting for
        data, attention pairs inside documents (attention_pairs(), its share under context
        parallel) and whether a profiler recorded the step (the record is then marked and left
        out of steady-state figures). The tokens the loss counted come with add_trained."""
        self.window_tokens += num_tokens
        self.window_pairs += attention_pairs
        self.window_data_time += data_time
        self.window_profiled |= profiled
        now = time.perf_counter()  # called once per step: also times the step for the ETA
        self.step_times.append(now - self.step_end)
        self.step_end = now

    def add_trained(self, trained_tokens: float) -> None:
        """A step's tokens the loss counted (its share of the global count), known once its
        values reach the host, which can be during the next step (StepValues)."""
        self.window_trained += trained_tokens

    def exclude_time(self, seconds: float) -> None:
        """Leave time spent outside training (validation) out of this window's tokens/s."""
        self.window_start += seconds
        self.step_end += seconds

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.config.log_freq == 0 or step == last_step

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Writes one record: values (loss, grad_norm, lr, tokens_seen, ...) plus throughput,
        memory and `time` (UNIX seconds)."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        processed = self.window_tokens / elapsed
        tflops = processed * self.flops_per_token / 1e12
        work = self.window_tokens * self.dense_flops_per_token
        tflops_doc = (work + self.window_pairs * self.attention_flops_per_pair) / elapsed / 1e12
        record: dict[str, Any] = {"step": step, "time": time.time(), **values}
        record.update(
            tps=self.window_trained / elapsed,
            tps_processed=processed,
            tflops=tflops,
            mfu=self._mfu(tflops),
            tflops_doc=tflops_doc,
            mfu_doc=self._mfu(tflops_doc),
            data_time_frac=self.window_data_time / elapsed,
            **self.memory.read_and_reset(),
        )
        if self.window_profiled:
            record["profiled"] = True
        self._reset_window()
        self.last_record = record
        if self.is_writer:
            self._write(record)
        return record

    def log_summary(self, tokens_seen: int, checkpoint_folder: str, newest: str) -> None:
        """The run's last console line (rank 0): the last logged loss, tokens trained (the
        loss's count, over all ranks and launches), wall time since the first step and where
        the outputs are. newest: the newest checkpoint's folder name, or "none"."""
        if not self.is_writer:
            return
        r = self.last_record
        loss = f"final loss {r['loss']:.4f} (step {r['step']})" if r else "no step trained"
        checkpoint = os.path.join(checkpoint_folder, newest) if newest != "none" else "none"
        logger.info(
            f"run ended: {loss}, {tokens_seen:,} tokens trained, wall time "
            f"{_hms(time.perf_counter() - self.launch_start)}; outputs in {self.dump_folder}: "
            f"metrics {self.path}, last checkpoint {checkpoint}"
        )

    def _mfu(self, tflops: float) -> float | None:
        return 100.0 * tflops / self.peak_tflops if self.peak_tflops else None

    def _write(self, r: dict[str, Any]) -> None:
        logger.info(self._console_line(r))
        assert self.jsonl is not None
        self.jsonl.write(json.dumps(r) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in r.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, r["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(r)

    def _console_line(self, r: dict[str, Any]) -> str:
        """step k/N, the values, then elapsed time and ETA; n/a where the device has no
        memory statistics or known peak (CPU) rather than a misleading 0."""
        mem = "mem n/a"
        if r["memory_max_reserved_pct"] is not None:  # only CUDA reports it
            mem = f"mem {r['memory_max_active_gib']:.2f}/{r['memory_max_reserved_gib']:.2f}GiB"
            mem += f" ({r['memory_max_reserved_pct']:.0f}%)"
        mfu = "mfu n/a"
        if self.peak_tflops:
            mfu = f"mfu {r['mfu']:.1f}% (doc {r['mfu_doc']:.1f}%)"
        of = f"/{self.last_step}" if self.last_step else ""
        line = (
            f"step {r['step']:>5}{of}  loss {r['loss']:.4f}  grad_norm {r['grad_norm']:.3f}  "
            f"lr {r['lr']:.2e}  tps {r['tps']:,.0f} (processed {r['tps_processed']:,.0f})  "
            f"tflops {r['tflops']:.1f}  {mfu}  {mem}  data {100 * r['data_time_frac']:.1f}%"
        )
        if "rewards/margins" in r:  # DPO
            line += _rewards(r, "", "rewards")
        if "validation_loss" in r:
            line += f"  val_loss {r['validation_loss']:.4f}"
        if "validation_rewards/margins" in r:
            line += _rewards(r, "validation_", "val_rewards")
        if "moe_aux_loss" in r:
            line += (
                f"  aux {r['moe_aux_loss']:.4f}  expert_load max/mean "
                f"{r['expert_load_imbalance']:.2f}"
            )
            if r.get("moe_force_load_balance"):
                line += " (forced round-robin)"
        line += f"  elapsed {_hms(time.perf_counter() - self.launch_start)}"
        if self.last_step and self.step_times:
            eta = statistics.median(self.step_times) * max(self.last_step - r["step"], 0)
            line += f"  eta {_hms(eta)}"
        return line

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def _rewards(r: dict[str, Any], prefix: str, label: str) -> str:
    """DPO's rewards (TRL's rewards/*) of a record, for the console line."""
    chosen, rejected = r[f"{prefix}rewards/chosen"], r[f"{prefix}rewards/rejected"]
    margin, accuracy = r[f"{prefix}rewards/margins"], r[f"{prefix}rewards/accuracies"]
    return (
        f"  {label} chosen/rejected {chosen:.3f}/{rejected:.3f}  margin {margin:.3f}  "
        f"acc {accuracy:.2f}"
    )


def _hms(seconds: float) -> str:
    """Seconds as h:mm:ss (hours unbounded: a run may last days)."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
