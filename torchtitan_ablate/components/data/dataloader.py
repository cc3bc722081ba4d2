"""build_dataloader: documents -> packed rows -> batches, resumable via StatefulDataLoader.

Each batch is a dict of LongTensors [B, S]: input_ids, labels (-100 = ignore), positions,
document_ids (see packing.py). The loader's state_dict() holds, per worker, the source position
(with the mixture's and shuffle buffer's draws and buffered documents, see mixing.py) and the
packing carry-over, so loading it into a freshly built loader continues exactly, also with
another num_workers or shuffle_buffer where the position carries over (loader_state.py).

Sources: synthetic, or text files (one path or a weighted mixture of several), optionally through
a shuffle buffer; chat files for SFT (sft.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import warnings

import torch

from torchtitan_ablate.components.data.datasets import (
    CHECK_BYTES,
    SyntheticDocuments,
    TextDocuments,
    list_text_files,
)
from torchtitan_ablate.components.data.loader_state import ResumableLoader
from torchtitan_ablate.components.data.mixing import MixedDocuments, ShuffledDocuments, Source
from torchtitan_ablate.components.data.packing import PACKING_MODES, PackedDataset
from torchtitan_ablate.components.data.preference import PreferenceDataset, PreferencePairs
from torchtitan_ablate.components.data.sft import SFT_PACKING_MODES, ChatDocuments, SFTDataset
from torchtitan_ablate.components.text.tokenizer import Tokenizer
from torchtitan_ablate.config.job_config import Training

DATASETS = ("synthetic", "text", "chat", "preference")

logger = logging.getLogger("torchtitan_ablate")


def build_dataloader(
    data: Training,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world_size: int,
    *,
    pin_memory: bool = False,
    max_bad_rows: int = 0,
) -> ResumableLoader:
    """This dp rank's infinite loader of the data that `data` (the [training] section, or a copy
    with validation's path and batch) describes: its dataset, dataset_path, dataset_weights,
    dataset_text_field, shuffle_buffer, packing, data_sharding, seq_len, local_batch_size,
    seed, synthetic_doc_len and num_workers. Chat files: sft.py; preference pairs for DPO:
    preference.py (max_bad_rows: rows skipped before the first bad row is an error, dpo's)."""
    dataset, dataset_path, packing = data.dataset, data.dataset_path, data.packing
    seq_len, local_batch_size, seed = data.seq_len, data.local_batch_size, data.seed
    # The user-facing rules on these values live in config/rules.py (load_config).
    modes = SFT_PACKING_MODES if dataset in ("chat", "preference") else PACKING_MODES
    assert dataset in DATASETS and packing in modes, (dataset, packing)
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be >= 1")
    assert dataset in ("text", "synthetic") or data.data_sharding == "documents", data
    assert dataset == "text" or not isinstance(dataset_path, list), dataset_path
    source: Source
    if dataset == "chat":  # SFT: assistant-only labels, conversations kept whole
        chats = ChatDocuments(list_text_files(dataset_path, dataset), tokenizer, seq_len)
        _check_up_front(chats)
        source = chats
    elif dataset == "preference":  # DPO: (chosen, rejected) pairs, response-only labels
        pairs = PreferencePairs(
            list_text_files(dataset_path, dataset), tokenizer, seq_len, max_bad_rows
        )
        _check_up_front(pairs)
        source = pairs
    elif dataset == "synthetic":
        source = SyntheticDocuments(tokenizer.vocab_size, seq_len, seed, data.synthetic_doc_len)
    elif isinstance(dataset_path, list):
        parts = [_text_source(p, tokenizer, data.dataset_text_field) for p in dataset_path]
        source = MixedDocuments(parts, data.dataset_weights or [1.0] * len(parts), seed)
    else:
        source = _text_source(dataset_path, tokenizer, data.dataset_text_field)
    # Also with shuffle_buffer 0: a checkpoint's buffer is then read out first (a resume that
    # turned shuffling off loses none of its documents).
    source = ShuffledDocuments(source, data.shuffle_buffer, seed)
    if dataset == "chat":
        rows = SFTDataset(source, seq_len, packing, tokenizer.pad_id, dp_rank, dp_world_size)
    elif dataset == "preference":
        rows = PreferenceDataset(source, seq_len, packing, tokenizer.pad_id, dp_rank, dp_world_size)
    else:
        rows = PackedDataset(
            source,
            seq_len=seq_len,
            packing=packing,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            sharding=data.data_sharding,
            local_batch_size=local_batch_size,
        )
    # An own generator: iter() would otherwise draw a seed from the global RNG, shifting every
    # random op after a resume (the checkpoint restores the global RNG before iter()).
    generator = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        # torchdata 0.11 on torch >= 2.13 calls a deprecated torch.set_vital; harmless noise.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return ResumableLoader(
            rows,
            batch_size=local_batch_size,
            num_workers=data.num_workers,
            pin_memory=pin_memory,
            generator=generator,
            worker_init_fn=_leave_sigterm_to_the_trainer if data.num_workers > 0 else None,
            shuffle_buffer=data.shuffle_buffer,
        )


def _text_source(path: str | None, tokenizer: Tokenizer, text_field: str) -> TextDocuments:
    source = TextDocuments(list_text_files(path, "text"), tokenizer, text_field)
    _check_up_front(source)
    return source


def _check_up_front(source: TextDocuments) -> None:
    if not source.check_lines():
        logger.info(
            f"data: checked the first {CHECK_BYTES / 2**30:.0f} GiB of {len(source.files)} files "
            "before training; the rest is checked as it is read"
        )


def _leave_sigterm_to_the_trainer(worker_id: int) -> None:
    """A loader worker ends on its training process's SIGTERM only. torchrun and batch
    schedulers send SIGTERM to every process of the job, and a worker killed by it would fail
    the step before the checkpoint that the trainer saves on that signal; the training process's
    own SIGTERM (how multiprocessing ends daemon workers at exit) still ends the worker. A Ctrl-C
    reaches every process of the terminal's foreground group: the trainer alone handles it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit it
    threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), daemon=True).start()


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)
