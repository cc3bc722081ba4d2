"""[validation]: the held-out loss is the token-weighted mean cross-entropy over the same rows at
every validation, it leaves training (losses, expert-load metrics) untouched, and it is the same
under data, context and expert parallel layouts of the same global rows."""

import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import build_trainer
from torchtitan_ablate.components.data import build_dataloader
from torchtitan_ablate.components.objective.loss import cross_entropy_sum, num_valid_tokens
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.config.job_config import Training

CORPUS = "assets/data/debug_corpus.jsonl"
VALIDATION = ["--validation.enable", "true", "--validation.dataset_path", CORPUS]
VALIDATION += ["--validation.freq", "2", "--validation.steps", "3"]
ROWS = ["--training.data_sharding", "rows"]
MOE = ["--model.flavor", "debugmodel_moe"]
AUX_OFF = ["--model.moe_aux_loss_coef", "0"]


def _reference_loss(trainer) -> float:
    """The held-out loss from scratch: a fresh loader of the validation rows, plain logits."""
    c, t = trainer.config.validation, trainer.config.training
    data = Training(
        dataset=t.dataset, dataset_path=c.dataset_path, seq_len=t.seq_len,
        local_batch_size=t.local_batch_size, packing=t.packing, seed=0,
        data_sharding=t.data_sharding,
    )  # fmt: skip
    loader = build_dataloader(data, trainer.tokenizer, 0, 1)
    loss, tokens = 0.0, 0
    with torch.no_grad():
        for _, batch in zip(range(c.steps), loader, strict=False):
            logits = trainer.model(batch["input_ids"], batch["positions"], batch["document_ids"])
            loss += cross_entropy_sum(logits, batch["labels"]).item()
            tokens += num_valid_tokens(batch["labels"]).item()
    return loss / tokens


def _train(dump_folder: str, args: list[str]) -> dict:
    trainer = build_trainer(dump_folder, args)
    records = trainer.train()
    out = {"records": records}
    if trainer.validator is not None:
        again = [trainer.validator.run(trainer.model, trainer.loss_fn) for _ in range(2)]
        out["again"] = again
        if dist.get_world_size() == 1:
            out["reference"] = _reference_loss(trainer)
    return out


def _same(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


def test_validation_loss_is_the_held_out_mean_and_training_is_unchanged(tmp_path):
    plain = run_distributed(_train, 1, str(tmp_path / "plain"), MOE)[0]["records"]
    run = run_distributed(_train, 1, str(tmp_path / "val"), MOE + VALIDATION)[0]
    records = run["records"]
    # Validated at every 2nd step and the last (5 steps, metrics.log_freq 1).
    assert [("validation_loss" in r) for r in records] == [False, True, False, True, True]
    assert records[1]["validation_loss"] > records[3]["validation_loss"]  # the model learns
    # Training and the expert-load metrics of each log window are exactly those without it.
    keys = ("loss", "grad_norm", "lr", "moe_aux_loss", "expert_load_max_over_mean")
    for r, p in zip(records, plain, strict=True):
        assert {k: r[k] for k in keys} == {k: p[k] for k in keys}
    # Every validation reads the same rows: again on the final model, the same figure.
    assert run["again"] == [records[-1]["validation_loss"]] * 2
    # No-grad chunked loss vs plain logits of a fresh loader.
    assert _same(records[-1]["validation_loss"], run["reference"])


def test_validation_loss_is_the_same_under_parallel_layouts(tmp_path):
    # The same global rows (rows sharding, 4 rows per step in all), as the training losses.
    one = VALIDATION + ROWS + ["--training.local_batch_size", "4"]
    two = VALIDATION + ROWS + ["--training.local_batch_size", "2"]
    layouts = {
        "fsdp2": (one, two),
        # Weights left gathered after the no-grad forward, then accumulation over 2 micro-batches.
        "zero2_accum": (
            one + ["--training.global_batch_size", "8"],
            two
            + ["--parallelism.fsdp_reshard_after_forward", "never"]
            + ["--training.global_batch_size", "8"],
        ),
        "cp2": (one, one + ["--parallelism.context_parallel_degree", "2"]),
        # The aux loss is per rank (as in HF and Megatron): off, so the layouts train alike.
        "ep2": (
            MOE + AUX_OFF + one,
            MOE + AUX_OFF + two + ["--parallelism.expert_parallel_degree", "2"],
        ),
    }
    refs = {}
    for name, (ref_args, args) in layouts.items():
        if tuple(ref_args) not in refs:
            run = run_distributed(_train, 1, str(tmp_path / f"{name}_ref"), ref_args)[0]
            refs[tuple(ref_args)] = run["records"]
        ref = refs[tuple(ref_args)]
        ranks = run_distributed(_train, 2, str(tmp_path / name), args)
        for r, p in zip(ranks[0]["records"], ref, strict=True):
            assert _same(r["loss"], p["loss"]), (name, r, p)
            if "validation_loss" in p:
                assert _same(r["validation_loss"], p["validation_loss"]), (name, r, p)
        assert ranks[0]["again"] == ranks[1]["again"]  # reduced over ranks


def _start_error(dump_folder: str, args: list[str]) -> str:
    try:
        build_trainer(dump_folder, args)
    except ConfigError as e:
        return str(e)
    return ""


def test_bad_held_out_data_is_named_before_training(tmp_path):
    bad = tmp_path / "held_out.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    args = VALIDATION[:2] + ["--validation.dataset_path", str(bad)]
    (err,) = run_distributed(_start_error, 1, str(tmp_path / "run"), args)
    assert err.startswith(f"validation.dataset_path: {bad}:2: JSONL line has no string"), err
