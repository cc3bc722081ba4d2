"""Data pipeline: document sources (datasets.py), packing (packing.py), chat SFT (sft.py),
loader (dataloader.py)."""

from torchtitan_ablate.components.data.dataloader import DATASETS, build_dataloader
from torchtitan_ablate.components.data.packing import (
    IGNORE_INDEX,
    PACKING_MODES,
    state_same_on_every_rank,
)
from torchtitan_ablate.components.data.sft import SFT_PACKING_MODES

__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "PACKING_MODES",
    "SFT_PACKING_MODES",
    "build_dataloader",
    "state_same_on_every_rank",
]
