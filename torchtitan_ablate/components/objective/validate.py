"""Held-out loss during training: the training model, loss function and data pipeline, on
`validation.steps` micro-batches per data-parallel rank, without gradients. With DPO: the
preference loss over held-out pairs and its reward metrics (accuracy, margin, ...).

Every validation reads the same micro-batches (the loader is rewound to its start), so the
figures of one run are comparable step to step; the loss is a sum over tokens divided by the
global valid-token count, as in training, so it is the same under any parallel layout of the
same global rows.
"""

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from torchtitan_ablate.components.data import build_dataloader
from torchtitan_ablate.components.data.datasets import KEY, DatasetError
from torchtitan_ablate.components.objective.loss import count_valid_tokens
from torchtitan_ablate.components.text.tokenizer import Tokenizer
from torchtitan_ablate.config.job_config import Training, Validation
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.distributed.context_parallel import place_micro_batch
from torchtitan_ablate.distributed.parallel_dims import ParallelDims

# A held-out synthetic stream: the training seed plus this, so no row repeats training's.
SYNTHETIC_SEED_OFFSET = 1_000_003


@contextmanager
def _naming_validation_data() -> Iterator[None]:
    """Data errors name the validation key, not training's (the readers share their checks)."""
    try:
        yield
    except DatasetError as e:
        raise DatasetError(str(e).replace(KEY, "validation.dataset_path")) from None


class Validator:
    def __init__(
        self,
        config: Validation,
        training: Training,
        tokenizer: Tokenizer,
        parallel_dims: ParallelDims,
        device: torch.device,
    ) -> None:
        self.config = config
        self.parallel_dims = parallel_dims
        self.device = device
        batch = config.local_batch_size
        # Held-out data of the training data's kind and packing, from validation's path: read in
        # file order, in one process, on a seed of its own (a synthetic stream then differs).
        held_out = dataclasses.replace(
            training,
            dataset_path=config.dataset_path,
            dataset_weights=[],
            local_batch_size=batch if batch != -1 else training.local_batch_size,
            seed=training.seed + SYNTHETIC_SEED_OFFSET,
            shuffle_buffer=0,
            num_workers=0,
        )
        with _naming_validation_data():
            self.loader = build_dataloader(
                held_out,
                tokenizer,
                parallel_dims.dp_rank(),
                parallel_dims.dp,
                pin_memory=device.type == "cuda",
            )
            self.start = self.loader.state_dict()
        for _ in self._micro_batches():  # bad held-out data fails now, not steps into the run
            pass

    def should_run(self, step: int, last_step: int) -> bool:
        return step % self.config.freq == 0 or step == last_step

    def _micro_batches(self) -> Iterator[dict]:
        """This rank's validation micro-batches, from the loader's start every time."""
        self.loader.load_state_dict(self.start)
        rows = iter(self.loader)
        with _naming_validation_data():
            for _ in range(self.config.steps):
                yield next(rows)

    @torch.no_grad()
    def run(
        self,
        parts: list[nn.Module],
        loss_of: Callable[[dict], torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]],
        loss_count: Callable[[dict], torch.Tensor] = count_valid_tokens,
    ) -> dict[str, float]:
        """validation_loss: the loss summed over all ranks' validation micro-batches, divided by
        their global loss_count (valid tokens: the mean cross-entropy per token; DPO: pairs).
        A loss function's own metrics (DPO's rewards/*, logps/*) come alike as validation_*.

        parts: this rank's model parts (the model, or its pipeline stages); loss_of(batch): a
        micro-batch's loss sum through them, forward only (build.Run.eval_loss: with pipeline
        parallel the schedule's eval, its sum on every pp rank, so the figure is every rank's)."""
        pd = self.parallel_dims
        # Validation routing must not count towards the expert-load metrics of the log window.
        moe_layers = [moe for part in parts for moe in part.moe_layers()]
        saved_load = [moe.tokens_per_expert.clone() for moe in moe_layers]
        # Eval mode: LoRA dropout off, so the figure is deterministic and no RNG is drawn.
        was_training = [part.training for part in parts]
        for part in parts:
            part.eval()
        sums: dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=self.device)
        for batch in self._micro_batches():
            batch = place_micro_batch(batch, pd, self.device)
            out = loss_of(batch)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0) + value.float()
            count += loss_count(batch)
        for part, mode in zip(parts, was_training, strict=True):
            part.train(mode)
        for moe, load in zip(moe_layers, saved_load, strict=True):
            moe.tokens_per_expert.copy_(load)
        totals = dist_utils.all_reduce_sum(torch.stack([*sums.values(), count]), pd.loss_group())
        means = (totals[:-1] / totals[-1].clamp(min=1)).tolist()
        return {f"validation_{name}": mean for name, mean in zip(sums, means, strict=True)}
