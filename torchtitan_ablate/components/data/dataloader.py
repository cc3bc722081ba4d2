"""build_dataloader: documents -> packed rows -> batches, resumable via StatefulDataLoader.

Each batch is a dict of LongTensors [B, S]: input_ids, labels (-100 = ignore), positions,
document_ids (see packing.py). The loader's state_dict() holds, per worker, the source position
and the packing carry-over, so loading it into a freshly built loader continues exactly.
"""

from __future__ import annotations

import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_ablate.components.data.datasets import (
    SyntheticDocuments,
    TextDocuments,
    list_text_files,
)
from torchtitan_ablate.components.data.packing import PACKING_MODES, PackedDataset
from torchtitan_ablate.components.data.sft import SFT_PACKING_MODES, ChatDocuments, SFTDataset
from torchtitan_ablate.components.tokenizer import Tokenizer

DATASETS = ("synthetic", "text", "chat")


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    packing: str,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    data_sharding: str = "documents",
) -> StatefulDataLoader:
    """Build this dp rank's infinite loader. dataset_path: a .txt/.jsonl file or folder (chat:
    .jsonl conversations, see sft.py)."""
    # The user-facing rules on these values live in config/validation.py (load_config).
    modes = SFT_PACKING_MODES if dataset == "chat" else PACKING_MODES
    assert dataset in DATASETS and packing in modes, (dataset, packing)
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be >= 1")
    assert dataset != "chat" or data_sharding == "documents", data_sharding
    if dataset == "chat":  # SFT: assistant-only labels, conversations kept whole
        chats = ChatDocuments(list_text_files(dataset_path, dataset), tokenizer, seq_len)
        rows = SFTDataset(chats, seq_len, packing, tokenizer.pad_id, dp_rank, dp_world_size)
    else:
        if dataset == "synthetic":
            source = SyntheticDocuments(tokenizer.vocab_size, seq_len, seed)
        else:
            source = TextDocuments(list_text_files(dataset_path, dataset), tokenizer)
        rows = PackedDataset(
            source,
            seq_len=seq_len,
            packing=packing,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            sharding=data_sharding,
            local_batch_size=local_batch_size,
        )
    # An own generator: iter() would otherwise draw a seed from the global RNG, shifting every
    # random op after a resume (the checkpoint restores the global RNG before iter()).
    generator = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        # torchdata 0.11 on torch >= 2.13 calls a deprecated torch.set_vital; harmless noise.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(
            rows,
            batch_size=local_batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=generator,
        )
