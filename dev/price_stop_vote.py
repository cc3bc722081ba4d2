"""Measuring tool only: the price of the ranks' stop vote (SIGTERM, throughput verdict) on one
GPU, where the trainer skips it. VOTE=late: the vote as several ranks cast it (queued each step,
read a step late); VOTE=now: read at once each step (a host wait for the GPU, as before the
vote was read late). Same arguments as torchtitan_ablate.train:

    VOTE=now python3 dev/price_stop_vote.py --job.config_file train_configs/qwen3_0.6b.toml ...
"""

import os

import torchtitan_ablate.train as t
from torchtitan_ablate.distributed import utils as dist_utils

NOW = os.environ["VOTE"] == "now"


class CastAlone(dist_utils.AnyRankLater):
    def __init__(self, device) -> None:
        super().__init__(device)
        self.alone = False  # one process: the all-reduce is skipped, the copy and read are not

    def __call__(self, flags: list[bool], now: bool) -> list[bool]:
        return super().__call__(flags, now or NOW)


dist_utils.AnyRankLater = CastAlone
t.run_main(t.main)
