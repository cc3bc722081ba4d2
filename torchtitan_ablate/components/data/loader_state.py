"""A data loader's checkpointed state carried to another loader layout on resume.

StatefulDataLoader keeps one shape of state per layout: with training.num_workers = 0 one
dataset state of the main process, with N > 0 workers one per worker under `_snapshot`. A
resume with another training.num_workers:
  0 <-> 1     both read the same one shard of this rank's documents: the state carries over
              and the data continues exactly;
  rows        (data_sharding = "rows") every worker reads the whole stream and keeps every N-th
              micro-batch, so the worker that made the newest batch holds the exact position of
              the stream: every new worker starts there, and the first batch comes from the
              worker whose turn it is; the data continues exactly;
  otherwise   with documents sharding each worker reads its own share of the documents (shard =
              rank x workers + worker): no layout of N workers holds the position of another, so
              the resume is refused with one line (ConfigError) naming the value that works.
A change of training.shuffle_buffer is handled by mixing.ShuffledDocuments (a bigger saved
buffer is read out first) and stated here in one line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_ablate.config import ConfigError

logger = logging.getLogger("torchtitan_ablate")

SNAPSHOT, MAIN, WORKERS = "_snapshot", "_main_snapshot", "_worker_snapshots"
# The loader-level counters both shapes hold (in the multi-worker one, in its main snapshot).
_COUNTERS = (
    "_index_sampler_state",
    "_sampler_iter_state",
    "_sampler_iter_yielded",
    "_IterableDataset_len_called",
    "_shared_seed",
)
_FRESH_FETCHER = {"dataset_iter_state": None, "fetcher_ended": False}  # never mutated


class ResumableLoader(StatefulDataLoader):
    """A StatefulDataLoader whose load_state_dict takes the state of another num_workers or
    shuffle_buffer (see the module docstring), or raises ConfigError when it cannot."""

    def __init__(self, *args: Any, shuffle_buffer: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shuffle_buffer = shuffle_buffer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            state_dict = translate(state_dict, self.num_workers, self._micro_batch, self.generator)
            buffered = saved_shuffle_buffer(state_dict)
            if buffered is not None and buffered != self.shuffle_buffer:
                logger.info(shuffle_change_line(buffered, self.shuffle_buffer))
        super().load_state_dict(state_dict)

    @property
    def _micro_batch(self) -> int:
        """Rows of one global micro-batch (rows sharding's unit of worker turns)."""
        return getattr(self.dataset, "dp_world_size", 1) * (self.batch_size or 1)


def saved_workers(state: dict[str, Any]) -> int:
    """training.num_workers of the loader that saved `state`."""
    return state[SNAPSHOT][MAIN]["_num_workers"] if SNAPSHOT in state else 0


def dataset_states(state: dict[str, Any]) -> list[dict[str, Any] | None]:
    """The saved dataset state of each worker (one for num_workers = 0), in worker order."""
    if SNAPSHOT not in state:
        return [state["dataset_state"]]
    workers = state[SNAPSHOT][WORKERS]
    return [(workers[f"worker_{i}"] or {}).get("dataset_state") for i in range(len(workers))]


def translate(
    state: dict[str, Any], num_workers: int, micro_batch: int, generator: torch.Generator | None
) -> dict[str, Any]:
    """`state` in the shape of a loader of `num_workers` workers; ConfigError when its position
    cannot be carried there. micro_batch: rows per global micro-batch (rows sharding)."""
    saved = saved_workers(state)
    if saved == num_workers:
        return state
    datasets = dataset_states(state)
    if SNAPSHOT in state:
        yielded = state[SNAPSHOT]["_snapshot_step"] + state["_steps_since_snapshot"]
        exact = state["_steps_since_snapshot"] == 0 and None not in datasets
        counters = state[SNAPSHOT][MAIN]
    else:
        yielded, exact, counters = state["_num_yielded"], True, state
    rows = exact and all(d.get("sharding") == "rows" for d in datasets)
    if exact and saved <= 1 and num_workers <= 1:
        position, next_worker = datasets[0], 0
    elif rows:  # the newest batch's worker is at the end of the last micro-batch consumed
        position = max(datasets, key=lambda d: d["rows_seen"])
        next_worker = position["rows_seen"] // micro_batch % max(num_workers, 1)
    else:
        raise ConfigError(
            f"training.num_workers = {num_workers}: the checkpoint's data position was saved by "
            f"a loader with training.num_workers = {saved}; with training.data_sharding = "
            "'documents' each loader worker reads its own share of the documents, so that "
            f"position holds for {saved} workers only: resume with --training.num_workers "
            f"{saved}" + (" (0 and 1 are interchangeable)" if saved <= 1 else "")
        )
    logger.info(
        f"data: training.num_workers {saved} -> {num_workers}: the data continues exactly from "
        "the checkpoint's position"
    )
    common = {k: counters[k] for k in _COUNTERS}
    finished = state.get("_iterator_finished", False)
    if num_workers == 0:
        return {
            **common,
            "_num_yielded": yielded,
            "fetcher_state": _FRESH_FETCHER,
            "dataset_state": position,
            "_iterator_finished": finished,
        }
    workers = {
        f"worker_{i}": {"dataset_state": position, "fetcher_state": _FRESH_FETCHER, "worker_id": i}
        for i in range(num_workers)
    }
    main = {**common, "_num_workers": num_workers, "_base_seed": _base_seed(state, generator)}
    return {
        SNAPSHOT: {
            "_snapshot_step": yielded,
            "_last_yielded_worker_id": (next_worker - 1) % num_workers,
            MAIN: main,
            WORKERS: workers,
        },
        "_steps_since_snapshot": 0,
        "_iterator_finished": finished,
    }


def _base_seed(state: dict[str, Any], generator: torch.Generator | None) -> int:
    """The saved workers' base seed, else the one a fresh iterator would draw (the loader's
    generator is left as it is)."""
    if SNAPSHOT in state:
        return state[SNAPSHOT][MAIN]["_base_seed"]
    draw = torch.Generator()
    if generator is not None:
        draw.set_state(generator.get_state())
    return int(torch.empty((), dtype=torch.int64).random_(generator=draw).item())


def saved_shuffle_buffer(state: dict[str, Any]) -> int | None:
    """Documents in the saved shuffle buffer (0 when it was off); None when it cannot be told."""
    datasets = dataset_states(state)
    if not datasets or datasets[0] is None or "source" not in datasets[0]:
        return None
    source = datasets[0]["source"]
    return len(source["buffer"]) if "buffer" in source else 0


def shuffle_change_line(saved: int, size: int) -> str:
    """The log line of a resume with another training.shuffle_buffer."""
    if saved > size:
        what = (
            f"the {saved - size} documents of the checkpoint's buffer that this one cannot hold "
            "come first"
        )
    else:
        what = "the buffer fills up from the checkpoint's position"
    return (
        f"data: training.shuffle_buffer {saved} -> {size}: {what}; no document is skipped or "
        "read twice"
    )
