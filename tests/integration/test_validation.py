"""[validation]: the held-out loss is the token-weighted mean cross-entropy over the same rows at
every validation, it leaves training (losses, expert-load metrics) untouched, and it is the same
under data, context and expert parallel layouts of the same global rows. With DPO: the held-out
preference loss, reward accuracy and margin are TRL's over the validation pairs, on the console
line too."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import captured_log, run_distributed
from tests.helpers.hf_model import make_hf
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
        run = trainer.run
        again = [trainer.validator.run(run.model_parts, run.eval_loss) for _ in range(2)]
        out["again"] = [figures["validation_loss"] for figures in again]
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


PAIRS = Path(__file__).resolve().parents[2] / "assets/preference/debug_preference.jsonl"
BETA = 0.5


def _dpo_args(hf_dir: Path, held_out: Path | None) -> list[str]:
    args = [
        "--model.flavor", "auto", "--model.tokenizer_path", "assets/tokenizer/debug.tiktoken",
        "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_format", "hf",
        "--training.dataset", "preference", "--training.dataset_path", str(PAIRS),
        "--training.local_batch_size", "2", "--training.steps", "4", "--dpo.beta", str(BETA),
    ]  # fmt: skip
    if held_out is not None:
        args += ["--validation.enable", "true", "--validation.dataset_path", str(held_out)]
        args += ["--validation.freq", "2", "--validation.steps", "3"]
    return args


@torch.no_grad()
def _sequence_logps(model, batch: dict) -> list[list[float]]:
    """Per row, the summed log-probability of each document's labels (plain logits)."""
    logits = model(batch["input_ids"], batch["positions"], batch["document_ids"]).float()
    labels = batch["labels"]
    valid = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = logp * valid
    return [
        [float(logp[b][batch["document_ids"][b] == d].sum()) for d in range(2 * int(n))]
        for b, n in enumerate(batch["num_pairs"])
    ]


def _dpo_held_out(trainer) -> dict[str, float]:
    """TRL's sigmoid loss, reward accuracy and margin over the held-out pairs, from scratch: a
    fresh loader of the validation rows, the policy's and the reference copy's plain logits."""
    c, t = trainer.config.validation, trainer.config.training
    data = Training(
        dataset="preference", dataset_path=c.dataset_path, seq_len=t.seq_len,
        local_batch_size=t.local_batch_size, packing=t.packing, seed=0,
    )  # fmt: skip
    loader = build_dataloader(data, trainer.tokenizer, 0, 1)
    losses, wins, margins = [], [], []
    for _, batch in zip(range(c.steps), loader, strict=False):
        policy = _sequence_logps(trainer.model, batch)
        reference = _sequence_logps(trainer.run.reference, batch)
        for p_row, r_row in zip(policy, reference, strict=True):
            for k in range(0, len(p_row), 2):
                chosen = BETA * (p_row[k] - r_row[k])
                rejected = BETA * (p_row[k + 1] - r_row[k + 1])
                margin = torch.tensor(chosen - rejected, dtype=torch.float64)
                losses.append(-float(torch.nn.functional.logsigmoid(margin)))
                wins.append(float(chosen > rejected))
                margins.append(chosen - rejected)
    n = len(losses)
    return {"loss": sum(losses) / n, "accuracy": sum(wins) / n, "margin": sum(margins) / n}


def _dpo_train(dump_folder: str, args: list[str]) -> dict:
    trainer = build_trainer(dump_folder, args)
    with captured_log() as lines:
        records = trainer.train()
    out = {"records": records, "lines": [x for x in lines if x.startswith("step")]}
    if trainer.validator is not None:
        out["held_out"] = _dpo_held_out(trainer)
    return out


def test_dpo_validation_is_the_held_out_preference_loss_and_reward_accuracy(tmp_path):
    hf_dir = tmp_path / "hf"
    make_hf("dense", hf_dir, vocab_size=2048)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[-40:]))
    plain = run_distributed(_dpo_train, 1, str(tmp_path / "plain"), _dpo_args(hf_dir, None))[0]
    run = run_distributed(_dpo_train, 1, str(tmp_path / "val"), _dpo_args(hf_dir, held_out))[0]
    records = run["records"]
    assert [("validation_loss" in r) for r in records] == [False, True, False, True]
    # Training, its rewards included, is exactly that without validation.
    for r, p in zip(records, plain["records"], strict=True):
        assert {k: r[k] for k in p if k.startswith(("loss", "rewards/"))} == {
            k: p[k] for k in p if k.startswith(("loss", "rewards/"))
        }
    last, expected = records[-1], run["held_out"]
    assert _same(last["validation_loss"], expected["loss"])
    assert last["validation_rewards/accuracies"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert _same(last["validation_rewards/margins"], expected["margin"], rtol=1e-4)
    # The preferences learnt carry over to the held-out pairs (policy == reference: ln 2, 0).
    assert records[1]["validation_loss"] > last["validation_loss"]
    assert last["validation_loss"] < 0.69 and last["validation_rewards/accuracies"] > 0.5
    # The console line: the step's rewards, and the held-out ones where it validated.
    assert all(" rewards chosen/rejected " in line for line in run["lines"])
    assert [" val_rewards " in line for line in run["lines"]] == [False, True, False, True]
    acc = f"val_loss {last['validation_loss']:.4f}  val_rewards chosen/rejected"
    assert acc in run["lines"][-1]
    assert f"acc {last['validation_rewards/accuracies']:.2f}" in run["lines"][-1]
