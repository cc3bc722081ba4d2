"""Trainer: `python -m torchtitan_ablate.train --job.config_file X [--section.key value ...]`.

The run is built by build.py (layout and meshes -> data -> model, optimizer, schedule, loss),
the step is step.train_step; this file adds what only training has: checkpoints, metrics,
validation, profilers, preemption and the loop. Legend: B batch, S sequence, V vocabulary.
"""

import gc
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

if __name__ == "__main__":  # --help and a config error answer before torch's imports (seconds)
    from torchtitan_ablate.config.precheck import check_before_torch

    check_before_torch(sys.argv[1:], "python -m torchtitan_ablate.train")
    from torchtitan_ablate.library_warnings import filter_library_warnings

    filter_library_warnings()

from torchtitan_ablate.cuda_allocator import ALLOC_CONF

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # before CUDA's first allocation

import torch

from torchtitan_ablate.build import build_data, build_layout, build_run, resolve_steps
from torchtitan_ablate.components.checkpoint.dump_lock import claim
from torchtitan_ablate.components.checkpoint.hf_export import save_last_in_hf
from torchtitan_ablate.components.checkpoint.state import TrainState
from torchtitan_ablate.components.objective.dpo import init_reference
from torchtitan_ablate.components.objective.finite import NonFiniteError, StepValues
from torchtitan_ablate.components.objective.validate import Validator
from torchtitan_ablate.components.observability.comm_profile import CommProfiler
from torchtitan_ablate.components.observability.expert_load import moe_step_metrics
from torchtitan_ablate.components.observability.metrics import MetricsLogger, attention_pairs
from torchtitan_ablate.components.observability.profiling import TraceProfiler
from torchtitan_ablate.components.observability.throughput_stop import throughput_measured
from torchtitan_ablate.components.observability.trackers import check_trackers
from torchtitan_ablate.components.preemption import Preemption
from torchtitan_ablate.components.rank_moe import RankMoE
from torchtitan_ablate.config import JobConfig, check_dump_folder, run_main, write_config
from torchtitan_ablate.config.dpo_config import DPO_FLOPS_FACTOR, dpo_enabled
from torchtitan_ablate.config.errors import report
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.run_checkpoint import build_checkpointer
from torchtitan_ablate.seed_checkpoint import create_seed_checkpoint
from torchtitan_ablate.step import next_micro_batches, train_step

logger = logging.getLogger("torchtitan_ablate")

EXIT_NONFINITE = 3  # training stopped on a NaN/Inf (2 is a config error)


class Trainer:
    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.device = dist_utils.pick_device(config.training.device)
        check_dump_folder(config.job.dump_folder)  # every rank: all stop with the same line
        check_trackers(config.metrics)
        world_size = dist_utils.init_distributed(self.device, config.comm.init_timeout_seconds)
        self.lock = claim(config.job.dump_folder)  # before anything there is read or written
        layout = build_layout(config, world_size, self.device.type)
        pd = self.parallel_dims = layout.parallel_dims
        self.model_args, self.grad_accum = layout.model_args, layout.grad_accum
        self.is_writer = torch.distributed.get_rank() == 0
        if config.training.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        # Metrics before the long build: a W&B login error shows at once. FLOPs per token, and
        # for the work-done figure 6 * params (seq_len 0) and the attention FLOPs per (query,
        # key) pair; DPO adds the reference model's forward.
        factor = DPO_FLOPS_FACTOR if dpo_enabled(config) else 1.0

        def flops(seq_len: int) -> float:
            return factor * self.model_args.num_flops_per_token(seq_len)

        self.metrics = MetricsLogger(
            config.metrics,
            config.job.dump_folder,
            self.device,
            flops(config.training.seq_len),
            self.is_writer,
            run_config=asdict(config),
            dense_flops_per_token=flops(0),
            attention_flops_per_pair=flops(1) - flops(0),
        )

        # 1. Tokenizer and data (before the model: a data error shows before the long build).
        self.tokenizer, self.dataloader = build_data(config, layout, self.device)
        config = self.config = resolve_steps(config, layout, self.tokenizer)  # training.epochs
        self.validator = None
        if config.validation.enable:
            self.validator = Validator(
                config.validation, config.training, self.tokenizer, pd, self.device
            )

        # 2. Model (meta build, parallelize, materialize, initialize), optimizer, schedule, loss.
        self.run = build_run(config, layout, self.device)
        self.model = self.run.model
        self.optimizer, self.lr_scheduler = self.run.optimizer, self.run.lr_scheduler
        self.loss_fn = self.run.loss_fn

        # 3. Checkpoint and profilers.
        self.train_state = TrainState()
        self.checkpointer = build_checkpointer(
            config, layout, self.run, self.dataloader, self.train_state
        )
        self.comm_profiler = CommProfiler(
            config.metrics,
            config.job.dump_folder,
            self.device,
            self.is_writer,
            config.training.steps,
            warmup_steps=config.training.throughput_warmup_steps,
            pipeline=self.run.pipeline,
            pp_rank=pd.pp_rank(),
        )
        self.trace_profiler = TraceProfiler(
            config.profiling, config.job.dump_folder, torch.distributed.get_rank(), self.device
        )
        self.step = self.nonfinite_in_a_row = self.step_pairs = 0
        self.pending: tuple[int, StepValues] | None = None  # a step whose values are unread
        self.preemption = Preemption(config.training.sigterm_grace_seconds, self._on_hang)
        self.stop_vote = dist_utils.AnyRankLater(self.device)
        n_params, n_trainable = self.run.num_params()
        if config.job.description:
            logger.info(f"job: {config.job.description}")
        logger.info(
            f"model {config.model.flavor}: {n_params:,} parameters ({n_trainable:,} trainable); "
            f"world {world_size} ({pd}); grad accumulation {self.grad_accum}; device {self.device}"
        )
        if config.debug.moe_force_load_balance:
            logger.warning(
                "debug.moe_force_load_balance = true: MoE tokens are routed round-robin, not by "
                "the routers (benchmarks only)"
            )

    def next_batches(self, data_iter: Iterator) -> tuple[list[dict], float]:
        """This step's micro-batches on the device, and the seconds spent waiting for them."""
        start = time.perf_counter()
        self.step_pairs = 0
        batches = next_micro_batches(data_iter, self.run, self.device, self._count_pairs)
        return batches, time.perf_counter() - start

    def _count_pairs(self, batch: dict) -> None:
        """Attention pairs of a loader batch (whole rows, before the CP slice), on the host."""
        ids = batch.get("document_ids")
        batch_size, seq_len = batch["input_ids"].shape
        self.step_pairs += attention_pairs(ids, seq_len, batch_size)

    def train_step(self, batches: list[dict]) -> dict:
        return train_step(self.run, batches, guard_nonfinite=True)

    def train(self) -> list[dict]:
        config = self.config
        self.step = self.checkpointer.load()
        if self.is_writer:  # only once the run starts: its config and resume checks passed
            write_config(config, os.path.join(config.job.dump_folder, "config.toml"))
        if self.step:
            logger.info(f"resumed from step {self.step}")
        elif self.run.reference is not None:  # DPO: the reference starts from the loaded weights
            init_reference(self.model, self.run.reference)
        last = config.training.steps
        self.metrics.open(resumed_step=self.step, last_step=last)
        self.preemption.install()  # SIGTERM, Ctrl-C: stop and save at the step's end, or exit
        gc.disable()
        data_iter = iter(self.dataloader)
        records = []
        first = self.step + 1
        while self.step < last:
            self.step += 1
            self.preemption.step_started(self.step)
            if self.step % config.training.gc_freq == 0:
                gc.collect(1)
            batches, data_time = self.next_batches(data_iter)
            lr = self.lr_scheduler.get_last_lr()[0]
            out = self.train_step(batches)
            self._settle()  # the last step's values, now that this one is queued
            self.pending = (self.step, out["check"])
            if out["check"].is_read:  # train_step read them (no skip on the device): settle now
                self._settle()
            self.comm_profiler.step(self.step)
            self.trace_profiler.step(self.step)
            pd = self.parallel_dims  # the cp, tp and pp ranks of a row share its work (each
            self.metrics.add_tokens(  # holds the whole row's ids: count 1 / (tp * pp) of them)
                sum(b["input_ids"].numel() for b in batches) // (pd.tp * pd.pp),
                data_time,
                attention_pairs=self.step_pairs / (pd.cp * pd.tp * pd.pp),
                profiled=self.comm_profiler.covers(self.step),
            )
            self.train_state.step = self.step
            validate = self.validator is not None and self.validator.should_run(self.step, last)
            log_now = self.metrics.should_log(self.step, last) or validate
            if log_now:
                self._settle()
                values = self._reduce(out, lr)
                values["tokens_seen"] = self.train_state.tokens_seen
                if validate:
                    start = time.perf_counter()
                    run = self.run
                    values |= self.validator.run(run.model_parts, run.eval_loss, run.loss_count)
                    self.metrics.exclude_time(time.perf_counter() - start)
                records.append(self.metrics.log(self.step, values))
            # All ranks stop (and save) at the same step: a SIGTERM to any rank and rank 0's
            # throughput verdict are voted on, read a step late where the host would wait.
            measured = log_now and throughput_measured(records, config.training, self.is_writer)
            flags = [self.preemption.requested, measured and self.is_writer]
            due = self.checkpointer.due(self.step)
            sigterm, measured = self.stop_vote(flags, now=log_now or self.step == last or due)
            self.preemption.step_ended()  # a step later, the next step's grace covers the stop
            stop = self.step == config.training.exit_at_step or sigterm or measured
            force = self.step == last or stop
            if force or due:  # a saved step is a settled one
                self._settle()
            saved = self.checkpointer.save(self.step, force=force)
            ck = config.checkpoint
            if saved and self.step == last and ck.last_save_in_hf and self.is_writer:
                save_last_in_hf(self.checkpointer.step_dir(self.step), ck.export_dtype)
            if self.step == first:  # start-up is over: a stalled rank now fails the others sooner
                dist_utils.set_timeout(config.comm.train_timeout_seconds)
            if stop and self.step < last:
                why = self.preemption.stop_reason() if sigterm else "training.exit_at_step"
                if measured and not sigterm:
                    why = "tokens/s measured: training.throughput_noise_target"
                what = "checkpoint saved" if saved else "checkpointing is off: nothing saved"
                logger.info(f"stopping at step {self.step} ({why}; {what})")
                break
        gc.enable()
        self.preemption.restore()
        self.comm_profiler.close()
        self.trace_profiler.close()
        self.metrics.log_summary(
            self.train_state.tokens_seen, self.checkpointer.folder, self._newest()
        )
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()
        return records

    def _reduce(self, out: dict, lr: float) -> dict:
        """Step outputs as floats averaged over ranks (loss over dp*cp), plus expert load."""
        pd = self.parallel_dims
        group = pd.loss_group()
        values = {"loss": dist_utils.all_reduce_sum(out["loss"].clone(), group).item()}
        values["grad_norm"] = float(out["grad_norm"])
        values["lr"] = lr
        if out["loss_metrics"]:  # DPO's rewards/* and logps/*, normalised as the loss
            names = list(out["loss_metrics"])
            sums = torch.stack([out["loss_metrics"][k] for k in names])
            values.update(zip(names, dist_utils.all_reduce_sum(sums, group).tolist()))
        if "moe_aux_loss" in out:
            moe, pp_group = RankMoE(self.run.model_parts), self.parallel_dims.pp_group()
            args = self.model.args
            values.update(moe_step_metrics(moe, args, out["moe_aux_loss"], group, pp_group))
        return values

    def _settle(self) -> None:
        """The pending step's values on the host: its trained tokens counted; it stops the run
        at the first non-finite step, or past training.skip_nonfinite_steps of them in a row
        (the step skipped its update). All ranks agree: the values are global."""
        if self.pending is None:
            return
        (step, check), self.pending = self.pending, None
        nonfinite, tokens = check.read()
        self.metrics.add_trained(tokens / self.parallel_dims.world_size)
        self.train_state.tokens_seen += tokens
        if nonfinite is None:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        limit = self.config.training.skip_nonfinite_steps
        if self.nonfinite_in_a_row <= limit:
            logger.warning(
                f"step {step}: non-finite {nonfinite}: optimizer step skipped "
                f"({self.nonfinite_in_a_row} of training.skip_nonfinite_steps = {limit} in a row)"
            )
            return
        in_a_row = f" ({self.nonfinite_in_a_row} steps in a row)" if limit else ""
        raise NonFiniteError(
            f"step {step}: non-finite {nonfinite}{in_a_row}: training stopped, nothing "
            f"saved at this step (newest checkpoint: {self._newest()})"
        )

    def _newest(self) -> str:
        saved = self.checkpointer.complete_steps() if self.config.checkpoint.enable else []
        return f"step-{saved[-1]}" if saved else "none"

    def _on_hang(self, step: int) -> str:
        """Before a step past the SIGTERM grace, or a second Ctrl-C, ends the process: frees
        the lock."""
        if self.lock is not None:
            self.lock.release()
        return f" (newest checkpoint: {self._newest()})"


def main(config: JobConfig) -> list[dict]:
    logging.basicConfig(
        level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
        format="[%(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    if config.memory_estimation.enable:
        from torchtitan_ablate.estimator import estimate_main

        return estimate_main(config)
    try:
        if config.checkpoint.create_seed_checkpoint:
            create_seed_checkpoint(config)
            return []
        trainer = Trainer(config)
        try:
            records = trainer.train()
            trainer.preemption.exit_if_interrupted()  # a Ctrl-C, once saved: exit code 130
            return records
        finally:  # the SIGTERM timer of a step that raised does not outlive it
            trainer.preemption.restore()
    except NonFiniteError as e:
        # One line and its own exit code, on every rank alike (all ranks agree on the values);
        # report() also leaves it for the multi-process launcher.
        report(f"error: {e}")
        raise SystemExit(EXIT_NONFINITE) from None
    finally:
        dist_utils.destroy_distributed()


if __name__ == "__main__":
    run_main(main)
