"""The model registry: model.name picks the family, and a second family (tiny_family.py, a test
double with its own sizes, model and parallelize recipe) builds, trains, shards over 2 gloo
ranks and is memory-estimated through the unchanged build path."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_family import TINY_SPEC, TinyArgs
from torchtitan_ablate.build import build_layout, build_run, check_layout
from torchtitan_ablate.config import ConfigError, JobConfig, load_config
from torchtitan_ablate.distributed.context_parallel import place_micro_batch
from torchtitan_ablate.estimator import estimate
from torchtitan_ablate.estimator.tracked_step import tracked_step
from torchtitan_ablate.models.common.init import canonical_name
from torchtitan_ablate.models.registry import get_spec, register, spec_for_args, unregister
from torchtitan_ablate.step import train_step

ROWS, SEQ = 4, 32  # the global batch of the step


def tiny_config(*extra: str) -> JobConfig:
    return load_config(
        ["--model.name", "tiny", "--model.flavor", "small", "--training.dataset", "synthetic"]
        + ["--training.seq_len", str(SEQ), "--memory_estimation.world_size", "2", *extra]
    )


@contextmanager
def tiny_registered() -> Iterator[None]:
    register(TINY_SPEC)
    try:
        yield
    finally:
        unregister(TINY_SPEC.name)


@pytest.fixture
def tiny_family():
    with tiny_registered():
        yield TINY_SPEC


def test_an_unknown_model_name_lists_the_registered_families(tiny_family):
    config = load_config(["--model.name", "llama3"])
    with pytest.raises(ConfigError) as err:
        check_layout(config, 1)
    message = str(err.value)
    assert message.startswith("model.name = 'llama3' is no registered model family: one of ")
    assert "qwen3" in message and "tiny" in message and "\n" not in message


def test_a_family_without_tensor_parallel_refuses_it(tiny_family):
    with pytest.raises(ConfigError, match="model.name = 'tiny' has no tensor parallel; set"):
        check_layout(tiny_config("--parallelism.tensor_parallel_degree", "2"), 2)


def test_the_family_is_found_by_name_and_by_its_sizes(tiny_family):
    layout = check_layout(tiny_config(), 1)
    assert isinstance(layout.model_args, TinyArgs)
    assert get_spec("tiny") is spec_for_args(layout.model_args) is TINY_SPEC
    with pytest.raises(ValueError, match="registered already"):
        register(TINY_SPEC)


def _global_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab_size, (ROWS, SEQ), generator=g),
        "labels": torch.randint(0, vocab_size, (ROWS, SEQ), generator=g),
        "positions": torch.arange(SEQ).repeat(ROWS, 1),
        "document_ids": torch.zeros(ROWS, SEQ, dtype=torch.int64),
    }


def _train_one_step(*extra: str) -> dict:
    """On each rank: the tiny family built by build.py, one step on this rank's rows of the
    global batch; the loss, the full parameters after the step, the FSDP plan."""
    with tiny_registered():
        world, rank = dist.get_world_size(), dist.get_rank()
        config = tiny_config("--training.local_batch_size", str(ROWS // world), *extra)
        layout = build_layout(config, world, "cpu")
        run = build_run(config, layout, torch.device("cpu"))
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        batch = {k: v[rows] for k, v in _global_batch(layout.model_args.vocab_size).items()}
        out = train_step(run, [place_micro_batch(batch, run.parallel_dims, torch.device("cpu"))])
        params = {
            canonical_name(k): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in run.model.named_parameters()
        }
        return {"loss": out["loss"].item(), "params": params, "plan": run.accumulation}


def _tracked_peak() -> int:
    """This rank's tracked peak of a steady-state step on real tensors (the estimator's own
    tracked step, as estimator/measure.py runs it)."""
    with tiny_registered():
        config = tiny_config("--training.local_batch_size", str(ROWS // 2))
        return tracked_step(config, dist.get_world_size(), torch.device("cpu")).tracker.peak


def test_one_step_sharded_and_checkpointed_equals_one_process():
    """FSDP over 2 ranks with full activation checkpointing (the family's own recipe, through
    distributed/'s apply_fsdp and apply_ac) against one process: same loss and weights after
    the step, float32, to 1e-6 / 1e-5."""
    (one,) = run_distributed(_train_one_step, 1)
    two = run_distributed(_train_one_step, 2, "--activation_checkpoint.mode", "full")
    assert one["plan"] is None and two[0]["plan"] is not None  # FSDP on 2 ranks only
    # Each rank's loss is its rows' share of the global mean (train_step reduces no loss).
    assert sum(rank["loss"] for rank in two) == pytest.approx(one["loss"], rel=1e-6)
    for rank in two:
        assert rank["params"].keys() == one["params"].keys()
        for name, p in one["params"].items():
            torch.testing.assert_close(rank["params"][name], p, rtol=1e-5, atol=1e-6)
    # The family's own size count is what build.py built.
    assert sum(p.numel() for p in one["params"].values()) == TinyArgs().num_params()


def test_the_estimator_builds_the_family_as_the_trainer_does(tiny_family):
    """The CPU estimate (fake tensors, fake process group) against the tracked peak of the same
    step on 2 real gloo ranks: within 2% of the quieter rank (gloo may free a collective's
    buffer late, only ever raising a rank's reading; tests/unit/memory/checks.py)."""
    config = tiny_config("--training.local_batch_size", str(ROWS // 2))
    est = estimate(config, target="cpu")
    assert est["n_params"] == TinyArgs().num_params()
    assert est["by_category"]["parameters"] > 0 and est["by_category"]["optimizer_states"] > 0
    measured = min(run_distributed(_tracked_peak, 2))
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.02), (est["peak_bytes"], measured)
    cuda = estimate(config)  # CUDA's program: its attention kernel and optimizer stood in
    assert cuda["peak_gib"] > 0 and cuda["n_params"] == est["n_params"]
