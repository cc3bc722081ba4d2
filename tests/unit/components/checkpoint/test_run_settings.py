"""Resuming with changed settings: the LR schedule follows this run's config and the step, every
optimizer / schedule key is applied, and each change is stated in one log line; another model,
LoRA or tokenizer is refused in one line, and other data starts from its first document."""

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.checkpoints import one_model_manager
from tests.helpers.data import BYTE, DOCS, write_jsonl
from torchtitan_ablate.components.checkpoint.run_settings import (
    data_changed,
    describe_changes,
    refusal,
    run_settings,
)
from torchtitan_ablate.components.data import build_dataloader
from torchtitan_ablate.components.optim.lr_scheduler import build_lr_scheduler
from torchtitan_ablate.components.optim.optimizer import build_optimizer
from torchtitan_ablate.config import ConfigError, JobConfig
from torchtitan_ablate.models.registry import get_spec

TOKENIZER = str(Path(__file__).resolve().parents[4] / "assets/tokenizer/debug.tiktoken")
LORA = {"lora.enable": True, "lora.rank": 4, "lora.alpha": 8.0}


def _config(**changes: object) -> JobConfig:
    """JobConfig() with `changes` given as {"section.key": value}."""
    config = JobConfig()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


def _build(config: JobConfig) -> tuple:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = build_optimizer([model], config.optimizer, "cpu")
    return model, opt, build_lr_scheduler(opt, config.lr_scheduler, config.training.steps)


def _manager(folder, config: JobConfig, model, opt, sched, settings: bool = True):
    recorded = run_settings(config, sequences_per_step=8) if settings else None
    return one_model_manager(folder, model, opt, sched, recorded)


def _train(model, opt, sched, n: int) -> list[float]:
    """n optimizer steps; returns the lr each one ran at."""
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return lrs


def _group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _changes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "changed on resume" in r.getMessage()]


@pytest.mark.parametrize("done, total", [(8, 12), (5, 10)])
def test_extending_a_run_follows_the_longer_schedule(tmp_path, caplog, done, total):
    """8 -> 12 steps ran step 9 at a negative lr; 5 -> 10 with 5 warmup steps jumped to the
    peak at step 6. Both now run each resumed step at the lr of a fresh `total`-step run."""
    first = _config(**{"training.steps": done, "lr_scheduler.warmup_steps": 5})
    model, opt, sched = _build(first)
    _train(model, opt, sched, done)
    _manager(tmp_path, first, model, opt, sched).save(done)

    longer = _config(**{"training.steps": total, "lr_scheduler.warmup_steps": 5})
    model, opt, sched = _build(longer)
    with caplog.at_level(logging.INFO):
        assert _manager(tmp_path, longer, model, opt, sched).load() == done
    resumed = _train(model, opt, sched, total - done)
    fresh = _train(*_build(longer), total)[done:]
    assert resumed == fresh and min(resumed) >= 0
    assert _changes(caplog) == [
        f"lr schedule changed on resume: training.steps {done} -> {total} (the lr from step "
        f"{done + 1} on follows this run's schedule)"
    ]


@pytest.mark.parametrize(
    "key, value",
    [
        ("optimizer.lr", 5e-4),
        ("optimizer.weight_decay", 0.01),
        ("optimizer.beta1", 0.8),
        ("optimizer.beta2", 0.99),
        ("optimizer.eps", 1e-6),
        ("optimizer.name", "Adam"),
        ("optimizer.implementation", "for-loop"),
        ("lr_scheduler.warmup_steps", 1),
        ("lr_scheduler.decay_ratio", 0.3),
        ("lr_scheduler.decay_type", "cosine"),
        ("lr_scheduler.min_lr_factor", 0.1),
        ("training.steps", 12),
        ("training.max_norm", 0.5),
    ],
)
def test_a_setting_changed_on_resume_is_applied_and_logged(tmp_path, caplog, key, value):
    # Saved at step 6 of 10, in the decay phase: every schedule key shapes the next lr.
    base = _config(**{"training.steps": 10})
    model, opt, sched = _build(base)
    _train(model, opt, sched, 6)
    _manager(tmp_path, base, model, opt, sched).save(6)
    old = run_settings(base, 8)[key]

    changed = _config(**{"training.steps": 10, key: value})
    model, opt, sched = _build(changed)
    with caplog.at_level(logging.INFO):
        _manager(tmp_path, changed, model, opt, sched).load()
    fresh = _build(changed)
    _train(*fresh, 6)
    # Every hyperparameter (the lr at this step included) is the new config's, as in a fresh
    # run of it; the moments and step counts are the checkpoint's.
    assert _group_settings(opt) == _group_settings(fresh[1])
    assert opt.state_dict()["state"][0]["step"] == 6
    assert sched.get_last_lr() == fresh[2].get_last_lr()
    (line,) = _changes(caplog)
    assert f" {key} {old} -> {value} (" in line


def test_batch_changes_are_stated():
    saved = run_settings(_config(), sequences_per_step=8)
    smaller = _config(**{"training.seq_len": 128, "training.local_batch_size": 4})
    effect = "(the data continues from the checkpoint's position)"
    assert describe_changes(saved, run_settings(smaller, 4), step=6) == [
        f"batch changed on resume: sequences per optimizer step 8 -> 4 {effect}",
        f"batch changed on resume: training.local_batch_size 8 -> 4 {effect}",
        f"batch changed on resume: training.seq_len 256 -> 128 {effect}",
    ]
    assert describe_changes(saved, saved, step=6) == []


def test_a_checkpoint_without_settings_still_resumes_on_this_runs_settings(tmp_path, caplog):
    """Checkpoints written before settings were recorded: this run's values apply, said once."""
    base = _config(**{"training.steps": 10})
    model, opt, sched = _build(base)
    _train(model, opt, sched, 4)
    _manager(tmp_path, base, model, opt, sched, settings=False).save(4)
    changed = _config(**{"training.steps": 10, "optimizer.lr": 5e-4})
    model, opt, sched = _build(changed)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, changed, model, opt, sched).load() == 4
    assert "records no settings" in caplog.text
    fresh = _build(changed)
    _train(*fresh, 4)
    assert _group_settings(opt) == _group_settings(fresh[1])


def _record(config: JobConfig) -> dict:
    """What a trainer records for `config`: its settings with the resolved model sizes."""
    build_args = get_spec(config.model.name).build_args
    args = build_args(config.model, config.training.seq_len, None, False)
    return run_settings(config, 8, args)


@pytest.mark.parametrize(
    "before, after, named",
    [
        (LORA, {**LORA, "lora.alpha": 16.0}, "with lora.alpha = 8.0, this run has 16.0: "),
        (LORA, {**LORA, "lora.rank": 8}, "with lora.rank = 4, this run has 8: "),
        (LORA, {**LORA, "lora.target_modules": ["q_proj"]}, "with lora.target_modules = ["),
        (LORA, {}, "with lora.enable = True, this run has False: "),
        ({}, LORA, "with lora.enable = False, this run has True: "),
        ({}, {"model.n_layers": 2}, "(model.n_layers -1 -> 2, n_layers 4 -> 2): resume with "
         "model.n_layers = -1, or"),
        ({}, {"model.vocab_size": 3000}, "(model.vocab_size -1 -> 3000, vocab_size 2048 -> 3000)"),
        ({}, {"model.flavor": "debugmodel_moe"}, "model.flavor 'debugmodel' -> 'debugmodel_moe'"),
        ({}, {"model.tokenizer_path": "byte"}, "was trained with another tokenizer ("),
    ],
)  # fmt: skip
def test_a_resume_that_would_change_the_model_is_refused(tmp_path, before, after, named):
    """lora.alpha was not recorded: a resume with another one scaled the adapters silently."""
    base = {"model.tokenizer_path": TOKENIZER}
    model, opt, sched = _build(_config())
    one_model_manager(tmp_path, model, opt, sched, _record(_config(**base | before))).save(1)
    model, opt, sched = _build(_config())
    weights = model.weight.clone()
    manager = one_model_manager(tmp_path, model, opt, sched, _record(_config(**base | after)))
    with pytest.raises(ConfigError) as e:
        manager.load()
    line = str(e.value)
    assert line.startswith(f"checkpoint {tmp_path}/step-1 ") and named in line, line
    assert "or start a new run in another job.dump_folder" in line and "\n" not in line
    assert torch.equal(model.weight, weights)  # refused before anything is loaded


def test_a_tokenizer_is_known_by_its_contents_not_its_path(tmp_path, caplog):
    """--model.tokenizer_path changed on resume went unnoticed (the loss jumped)."""
    copy = tmp_path / "copy.tiktoken"
    shutil.copy(TOKENIZER, copy)
    model, opt, sched = _build(_config())
    saved = _record(_config(**{"model.tokenizer_path": TOKENIZER}))
    one_model_manager(tmp_path / "ckpt", model, opt, sched, saved).save(1)
    moved = _record(_config(**{"model.tokenizer_path": str(copy)}))
    with caplog.at_level(logging.INFO):
        assert one_model_manager(tmp_path / "ckpt", model, opt, sched, moved).load() == 1
    assert _changes(caplog) == [
        f"model changed on resume: model.tokenizer_path {TOKENIZER} -> {copy} (the same "
        "tokenizer file contents)"
    ]
    copy.write_text("".join(Path(TOKENIZER).read_text().splitlines(True)[:-1]))  # one rank less
    edited = _record(_config(**{"model.tokenizer_path": str(copy)}))
    with pytest.raises(ConfigError, match=f"tokenizer \\(model.tokenizer_path = '{TOKENIZER}'"):
        one_model_manager(tmp_path / "ckpt", model, opt, sched, edited).load()


def test_what_a_resume_may_change_is_stated_with_its_effect():
    saved = _record(_config(**LORA))
    changed = {
        "training.seed": 7,
        "lora.dropout": 0.1,
        "model.attn_backend": "sdpa",
        "model.vocab_size": 2048,  # the flavor's: the same sizes
        "checkpoint.initial_load_path": "base",
        "training.packing": "padding",
        "training.num_workers": 2,  # recorded; the loader states what it does with it
    }
    current = _record(_config(**LORA, **changed))
    assert refusal(saved, current, "ckpt") is None and not data_changed(saved, current)
    assert current["training.num_workers"] == 2
    assert describe_changes(saved, current, step=6) == [
        "data loader changed on resume: training.packing greedy -> padding (the data continues "
        "from the checkpoint's position)",
        "model changed on resume: checkpoint.initial_load_path None -> base (not read on a "
        "resume: the weights come from the checkpoint)",
        "model changed on resume: lora.dropout 0.0 -> 0.1 (applied from step 7)",
        "model changed on resume: model.attn_backend auto -> sdpa (applied from step 7)",
        "model changed on resume: model.vocab_size -1 -> 2048 (the same model sizes)",
        "run changed on resume: training.seed 42 -> 7 (the weights, RNG states and data "
        "position come from the checkpoint; the data's random draws from here follow the new "
        "seed)",
    ]


def test_a_record_of_an_older_version_is_checked_for_what_it_holds():
    current = _record(_config(**LORA, **{"model.n_layers": 2}))
    older = {
        k: v
        for k, v in _record(_config()).items()
        if k.startswith(("optimizer.", "lr_scheduler.")) or k in ("training.steps",)
    }
    assert refusal(older, current, "ckpt") is None and not data_changed(older, current)
    assert describe_changes(older, current, step=6) == [
        "optimizer changed on resume: training.max_norm unset -> 1.0 (applied from step 7)",
        "batch changed on resume: sequences per optimizer step unset -> 8 (the data continues "
        "from the checkpoint's position)",
        "batch changed on resume: training.global_batch_size unset -> -1 (the data continues "
        "from the checkpoint's position)",
        "batch changed on resume: training.local_batch_size unset -> 8 (the data continues "
        "from the checkpoint's position)",
        "batch changed on resume: training.seq_len unset -> 256 (the data continues from the "
        "checkpoint's position)",
    ]


def _write(path: Path, docs: list[str]) -> Path:
    if path.suffix == ".jsonl":
        return write_jsonl(path, docs)
    path.write_text("\n\n".join(docs) + "\n")
    return path


def _text_config(path: Path) -> JobConfig:
    changes = {"training.seq_len": 16, "training.local_batch_size": 2}
    return _config(
        **changes, **{"model.tokenizer_path": "byte", "training.dataset_path": str(path)}
    )


def _data_manager(folder: Path, config: JobConfig, loader):
    model, opt, sched = _build(config)
    return one_model_manager(folder, model, opt, sched, run_settings(config, 2), loader)


def _loader(config: JobConfig):
    return build_dataloader(config.training, BYTE, 0, 1)


def _saved_after_3_batches(folder, config):
    """A loader's iterator 3 batches in, its state saved as step 3's checkpoint in `folder`."""
    loader = _loader(config)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    _data_manager(folder, config, loader).save(3)
    return batches


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_other_data_on_resume_starts_from_its_first_document(tmp_path, caplog, suffix):
    """An edited corpus resumed at the old byte offset: mid-paragraph for .txt, and for .jsonl
    a valid file reported as "invalid JSON at line N"."""
    corpus = _write(tmp_path / f"corpus{suffix}", DOCS)
    config = _text_config(corpus)
    _saved_after_3_batches(tmp_path / "ckpt", config)
    _write(corpus, ["a new first document, longer than the others"] + DOCS)
    fresh = next(iter(_loader(config)))
    resumed = _loader(config)
    with caplog.at_level(logging.INFO):
        assert _data_manager(tmp_path / "ckpt", config, resumed).load() == 3
    got = next(iter(resumed))
    assert all(torch.equal(got[k], fresh[k]) for k in fresh)
    (line,) = _changes(caplog)
    assert line.startswith(f"data changed on resume: {corpus} ") and " bytes, blake2b " in line
    assert line.endswith(" (the data starts again from its first document)")


def test_the_same_data_at_another_path_continues_from_its_position(tmp_path, caplog):
    corpus = _write(tmp_path / "corpus.jsonl", DOCS)
    config = _text_config(corpus)
    batches = _saved_after_3_batches(tmp_path / "ckpt", config)
    expected = next(batches)
    moved = tmp_path / "moved" / "corpus.jsonl"
    moved.parent.mkdir()
    shutil.copy(corpus, moved)
    moved_config = _text_config(moved)
    resumed = _loader(moved_config)
    with caplog.at_level(logging.INFO):
        assert _data_manager(tmp_path / "ckpt", moved_config, resumed).load() == 3
    got = next(iter(resumed))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert _changes(caplog) == [
        f"data changed on resume: training.dataset_path {corpus} -> {moved} (the same files' "
        "contents: the data continues from the checkpoint's position)"
    ]
