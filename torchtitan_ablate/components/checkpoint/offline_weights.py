"""The model weights of a DCP checkpoint in one process, without building the training state:
what scripts/convert_checkpoint.py exports and scripts/generate.py samples from. A training
checkpoint also holds optimizer, schedule and data-loader entries; only the model's are read,
with the record of what made it (run_settings.py): its model sizes, LoRA and tokenizer path.
"""

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_ablate.components.checkpoint.run_settings import MODEL_ARGS
from torchtitan_ablate.components.checkpoint.safe_reader import ForeignObject, SafeReader
from torchtitan_ablate.components.checkpoint.state import Damaged, read_record, saved_keys
from torchtitan_ablate.library_warnings import ignored
from torchtitan_ablate.models.registry import get_spec, state_dict_adapter


def find_run_toml(dcp_dir: Path) -> Path | None:
    """The config.toml of the run that wrote dcp_dir (its dump folder, two levels up from a
    step-N folder; up to three levels are searched)."""
    for parent in [dcp_dir, *list(dcp_dir.resolve().parents)[:3]]:
        if (parent / "config.toml").is_file():
            return parent / "config.toml"
    return None


def recorded_settings(dcp_dir: Path) -> dict[str, Any] | None:
    """What a training checkpoint records of the run that made it, as "section.key" -> value
    (run_settings.py); None for one that records no model (model-only, converted, or saved by
    an older version). Damage is left for read_dcp_model to name."""
    try:
        keys = saved_keys(str(dcp_dir))
        record = read_record(str(dcp_dir)) if "settings.pickle" in keys else None
    except Damaged:
        return None
    return record if isinstance(record, dict) and MODEL_ARGS in record else None


def recorded_args(record: dict[str, Any]) -> Any:
    """The model sizes a record holds, in its family's args class."""
    try:
        return get_spec(record["model.name"]).args_cls(**record[MODEL_ARGS])
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the checkpoint records model sizes this version cannot read ({e}); give the sizes "
            "(convert_checkpoint.py --flavor, generate.py --config)"
        ) from None


def check_sizes(found: dict[str, tuple[int, ...]], args: Any, dcp_dir: Path) -> None:
    """The checkpoint holds every weight of the model sizes (`args`, in its family's args
    class), in their shapes: wrong sizes are named before anything is loaded or written."""
    adapter = state_dict_adapter(args)
    expected = adapter.native_shapes()
    for alias in adapter.tied_keys():
        expected.pop(alias, None)  # tied checkpoints may store it once
    missing = [k for k in expected if k not in found]
    wrong = [k for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    if missing or wrong:
        key = (wrong or missing)[0]
        example = (
            f"{key} is {list(found[key])}, the sizes say {list(expected[key])}"
            if wrong
            else f"no {key}"
        )
        raise ValueError(
            f"{dcp_dir} does not match the model sizes ({len(wrong)} entries of another shape, "
            f"{len(missing)} missing; e.g. {example}): give the sizes it was trained with "
            "(convert_checkpoint.py --flavor, generate.py --config)"
        )


LORA_ADAPTER_KEY = re.compile(r"\.lora_[ab](_w[123])?$")  # linear: .lora_a; experts: .lora_a_w1


def read_dcp_model(dcp_dir: Path, args: Any) -> dict[str, torch.Tensor]:
    """The model entries (base weights and LoRA adapters) of a DCP checkpoint, as full tensors;
    a tied entry under its source's name only (StateDictAdapter.tied_keys)."""
    if not (dcp_dir / ".metadata").is_file():
        raise ValueError(
            f"{dcp_dir} is not a DCP checkpoint (no .metadata): give a "
            "<dump_folder>/checkpoint/step-N folder or one written by --to dcp"
        )
    try:
        metadata = SafeReader(str(dcp_dir)).read_metadata()
    except ForeignObject:
        raise  # its own line: the file names what a checkpoint may not hold
    except Exception as e:  # a cut-off or overwritten .metadata: any unpickling error
        raise ValueError(f"{dcp_dir}/.metadata is damaged ({type(e).__name__}: {e})") from None
    tensors = {
        k: tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    check_sizes(tensors, args, dcp_dir)
    conversion = state_dict_adapter(args)
    expected = conversion.native_shapes()
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        # Adapters by their own names: the optimizer's entries for them (".lora_a_w1.step")
        # carry the same infix.
        adapter = LORA_ADAPTER_KEY.search(key) is not None
        if isinstance(meta, TensorStorageMetadata) and (key in expected or adapter):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with ignored():  # DCP's warning of no process group: one process is meant here
            dcp.load(state, storage_reader=SafeReader(str(dcp_dir)), no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise ValueError(
            f"{dcp_dir} is damaged: its tensors cannot be read ({_first_error(e)}); convert "
            "another step"
        ) from None
    for alias in conversion.tied_keys():
        state.pop(alias, None)
    return state


def _first_error(e: BaseException) -> str:
    """The underlying error of DCP's CheckpointException (which wraps each rank's)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    first = str(e).strip().split(". ")[0].splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
