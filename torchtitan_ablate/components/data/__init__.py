"""Data pipeline: document sources (datasets.py), packing (packing.py), loader (dataloader.py)."""

from torchtitan_ablate.components.data.dataloader import DATASETS, build_dataloader
from torchtitan_ablate.components.data.packing import IGNORE_INDEX, PACKING_MODES

__all__ = ["DATASETS", "IGNORE_INDEX", "PACKING_MODES", "build_dataloader"]
