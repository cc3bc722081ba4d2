"""What a checkpoint records of the run that made it, and what a resume with other values does.

Recorded in every checkpoint, as "section.key" -> value:
  - the model: every model.* key, the resolved sizes (MODEL_ARGS, the family's args as a dict),
    lora.enable and, when it is on, every other lora.* key, the tokenizer's file contents
    (TOKENIZER) and where the weights came from (checkpoint.initial_load_path / _format);
  - the data: training.dataset, dataset_path, dataset_text_field and each file's size and hash
    (DATA_FILES, fingerprints.py); the loader's layout (packing, data_sharding, num_workers,
    shuffle_buffer, dataset_weights, synthetic_doc_len) and training.seed;
  - how to step: every optimizer.* and lr_scheduler.* key, training.steps and max_norm, and the
    batch (seq_len, batch sizes, sequences per step).
Export and generation rebuild the trained model from this record (offline_weights.py).

On resume (manager.py) this run's config decides how to step (state.py keeps the optimizer's
hyperparameters and recomputes the LR from the step); the record is compared with it:
  - `refusal`: another model family or sizes, another LoRA (enable, rank, alpha, targets) or
    another tokenizer is refused with one line: the weights would mean something else;
  - `data_changed`: other data (dataset, text field, any file's contents) restarts the data from
    its first document: the checkpoint's position points into data that is gone;
  - `describe_changes`: everything else is applied, one line per key, saying from where the
    LR, the optimizer and the data go on (num_workers and shuffle_buffer: the loader's to say).
A key the checkpoint lacks (an older version saved it) is stated as "unset" among the optimizer,
schedule and batch settings, which every version records, and is not compared elsewhere.
"""

import dataclasses
import logging
from typing import Any

from torchtitan_ablate.components.checkpoint.fingerprints import data_files, tokenizer_identity
from torchtitan_ablate.components.checkpoint.state import read_record
from torchtitan_ablate.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

SEQUENCES_PER_STEP = "sequences per optimizer step"
MODEL_ARGS = "model.args"
TOKENIZER = "tokenizer"
DATA_FILES = "data files"
_SCHEDULE = ("training.steps", "optimizer.lr")
_BATCH = (
    "training.seq_len",
    "training.local_batch_size",
    "training.global_batch_size",
    SEQUENCES_PER_STEP,
)
_DATA = ("training.dataset", "training.dataset_path", "training.dataset_text_field", DATA_FILES)
_LOADER_KEYS = (
    "packing",
    "data_sharding",
    "num_workers",
    "shuffle_buffer",
    "dataset_weights",
    "synthetic_doc_len",
)
_LOADER = tuple(f"training.{k}" for k in _LOADER_KEYS)
# Recorded, and left to the data loader to carry over (or refuse) and to state.
_LOADER_STATES = ("training.num_workers", "training.shuffle_buffer")
_SIZES = ("model.flavor", "model.vocab_size", "model.n_layers", "model.num_experts")
_LORA = ("lora.enable", "lora.rank", "lora.alpha", "lora.target_modules")
# Fields of MODEL_ARGS a run sets without changing what the weights mean.
_RUNTIME_ARGS = {
    "attn_backend",
    "max_seq_len",
    "moe_aux_loss_coef",
    "moe_bias_update_rate",
    "moe_grouped_mm",
    "moe_force_load_balance",
}
_KINDS = ("lr schedule", "optimizer", "batch", "data", "data loader", "model", "run")
_NEW_RUN = "or start a new run in another job.dump_folder"


def run_settings(
    config: JobConfig, sequences_per_step: int, model_args: Any = None
) -> dict[str, Any]:
    """The record to save in each checkpoint, as "section.key" -> value.

    sequences_per_step: local_batch_size x data-parallel degree x accumulation, which changes
    with the number of ranks when global_batch_size is -1. model_args: the resolved sizes (a
    dataclass of the model family's args class)."""
    settings: dict[str, Any] = {}
    sections = ["optimizer", "lr_scheduler", "model"] + (["lora"] if config.lora.enable else [])
    for section in sections:
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            settings[f"{section}.{key}"] = value
    settings["lora.enable"] = config.lora.enable
    if model_args is not None:
        settings[MODEL_ARGS] = dataclasses.asdict(model_args)
    settings[TOKENIZER] = tokenizer_identity(config.model.tokenizer_path)
    for key in ("initial_load_path", "initial_load_format"):
        settings[f"checkpoint.{key}"] = getattr(config.checkpoint, key)
    t = config.training
    keys = ("steps", "max_norm", "seq_len", "local_batch_size", "global_batch_size", "seed")
    for key in keys + ("dataset", "dataset_path", "dataset_text_field") + _LOADER_KEYS:
        settings[f"training.{key}"] = getattr(t, key)
    settings[DATA_FILES] = data_files(t)
    settings[SEQUENCES_PER_STEP] = sequences_per_step
    return settings


def checked_record(path: str, keys: set[str], current: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the checkpoint at `path` (whose entries are `keys`), once `refusal` let the
    resume go on (else ConfigError); None, with a warning, when the checkpoint records none."""
    saved = read_record(path) if "settings.pickle" in keys else None
    if not isinstance(saved, dict):
        logger.warning(
            f"checkpoint {path} records no settings (an older version saved it): this run's "
            "settings apply; what changed cannot be listed, nor its model and data checked"
        )
        return None
    line = refusal(saved, current, path)
    if line is not None:
        raise ConfigError(line)
    return saved


def refusal(saved: dict[str, Any], current: dict[str, Any], path: str) -> str | None:
    """One line when the checkpoint at `path` holds another model, LoRA or tokenizer than this
    run's (the first of them, naming the others); None when the resume may go on."""
    found: list[tuple[str, str]] = []
    sizes = _size_changes(saved.get(MODEL_ARGS), current.get(MODEL_ARGS))
    keys = [k for k in ("model.name", *_SIZES) if _differs(saved, current, k)]
    if sizes is not None and not sizes and "model.name" not in keys:
        keys = []  # the same sizes, set another way: stated as a change
    if keys or sizes:
        what = [f"{k} {saved[k]!r} -> {current.get(k)!r}" for k in keys]
        what += [f"{name} {old} -> {new}" for name, old, new in (sizes or [])[:4]]
        fix = " and ".join(f"{k} = {saved[k]!r}" for k in keys) or (
            "the sizes it was trained with (model.flavor 'auto': the config.json of "
            "checkpoint.initial_load_path)"
        )
        line = f"holds another model than this run builds ({', '.join(what)})"
        found.append(("the model", f"{line}: resume with {fix}"))
    lora = [k for k in _LORA if _differs(saved, current, k)]
    if lora:
        k = "lora.enable" if "lora.enable" in lora else lora[0]
        old, new = saved[k], current.get(k, "unset")
        line = (
            f"was trained with {k} = {old!r}, this run has {new!r}: the adapters' weights are "
            "defined by lora.enable, rank, alpha and target_modules (export merges "
            f"(alpha / rank) * B @ A); resume with {k} = {old!r}"
        )
        found.append(("the LoRA settings", line))
    if _differs(saved, current, TOKENIZER):
        old_path, new_path = saved.get("model.tokenizer_path"), current.get("model.tokenizer_path")
        line = (
            f"was trained with another tokenizer (model.tokenizer_path = {old_path!r}, "
            f"{saved[TOKENIZER]}) than this run's ({new_path!r}, {current.get(TOKENIZER)}): its "
            f"token ids would mean other text; resume with the tokenizer it was trained with"
        )
        found.append(("the tokenizer", line))
    if not found:
        return None
    also = f" (also changed: {', '.join(what for what, _ in found[1:])})" if found[1:] else ""
    return f"checkpoint {path} {found[0][1]}, {_NEW_RUN}{also}"


def data_changed(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether the checkpoint's data position points into other data than this run's (the files'
    contents count, not their paths)."""
    if _differs(saved, current, "training.dataset"):
        return True
    if _differs(saved, current, "training.dataset_text_field"):
        return True
    if DATA_FILES not in saved:
        return False
    return _contents(saved[DATA_FILES]) != _contents(current.get(DATA_FILES, []))


def describe_changes(
    saved: dict[str, Any], current: dict[str, Any], step: int, data_restarts: bool = False
) -> list[str]:
    """One line per setting that differs between a checkpoint (`saved`, at `step`) and this run
    (after `refusal` let it go on), by kind: schedule, optimizer, batch, data, loader, model,
    run. data_restarts: the data starts from its first document (other data, or a loader state
    that could not be restored)."""
    go_on = (
        "the data starts again from its first document"
        if data_restarts
        else "the data continues from the checkpoint's position"
    )
    lines = []
    for key in sorted(set(saved) | set(current), key=lambda k: (_kind(k), k)):
        kind = _kind(key)
        if key in (MODEL_ARGS, TOKENIZER, *_LOADER_STATES) or (kind > 2 and key not in saved):
            continue
        old, new = saved.get(key, "unset"), current.get(key, "unset")
        if key == DATA_FILES:
            if _contents(old) != _contents(new):
                lines.append(f"data changed on resume: {_files_change(old, new)} ({go_on})")
            continue
        if old != new:
            lines.append(f"{_KINDS[kind]} changed on resume: {key} {old} -> {new} "
                         f"({_effect(key, kind, step, go_on)})")  # fmt: skip
    return lines


def _effect(key: str, kind: int, step: int, go_on: str) -> str:
    if kind == 0:
        return f"the lr from step {step + 1} on follows this run's schedule"
    if key == "training.dataset_path" and go_on.endswith("position"):
        return f"the same files' contents: {go_on}"
    if kind in (2, 3, 4):
        return go_on
    if key in _SIZES:
        return "the same model sizes"
    if key == "model.tokenizer_path":
        return "the same tokenizer file contents"
    if key.startswith("checkpoint."):
        return "not read on a resume: the weights come from the checkpoint"
    if key == "training.seed":
        return (
            "the weights, RNG states and data position come from the checkpoint; the data's "
            "random draws from here follow the new seed"
        )
    return f"applied from step {step + 1}"


def _kind(key: str) -> int:
    """An index into _KINDS."""
    if key in _SCHEDULE or key.startswith("lr_scheduler."):
        return 0
    if key.startswith("optimizer.") or key == "training.max_norm":
        return 1
    for kind, keys in ((2, _BATCH), (3, _DATA), (4, _LOADER)):
        if key in keys:
            return kind
    if key.startswith(("model.", "lora.", "checkpoint.")) or key == TOKENIZER:
        return 5
    return 6


def _differs(saved: dict[str, Any], current: dict[str, Any], key: str) -> bool:
    """The checkpoint records `key` with another value than this run's."""
    return key in saved and saved[key] != current.get(key, "unset")


def _size_changes(old: dict | None, new: dict | None) -> list[tuple[str, Any, Any]] | None:
    """(field, old, new) of the resolved sizes that change the weights; None unless both sides
    recorded them."""
    if old is None or new is None:
        return None
    fields = sorted((set(old) | set(new)) - _RUNTIME_ARGS)
    return [(f, old.get(f), new.get(f)) for f in fields if old.get(f) != new.get(f)]


def _contents(files: list) -> list[tuple[int, str]]:
    return [(size, digest) for _, size, digest in files]


def _files_change(old: list, new: list) -> str:
    if len(old) != len(new):
        return f"{DATA_FILES}: {len(old)} -> {len(new)} files ({new[0][0] if new else 'none'} ...)"
    changed = [(a, b) for a, b in zip(old, new) if (a[1], a[2]) != (b[1], b[2])]
    (_, size, digest), (path, new_size, new_digest) = changed[0]
    more = f" and {len(changed) - 1} more files" if len(changed) > 1 else ""
    return f"{path} {size:,} bytes, {digest} -> {new_size:,} bytes, {new_digest}{more}"
