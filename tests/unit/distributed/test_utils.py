"""Process-group helpers: a clear error for an unusable device, and no barrier on the error path
(a rank that failed alone must not wait for peers stuck in another collective)."""

import pytest
import torch
import torch.distributed as dist

from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.distributed import utils as dist_utils


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="training.device = 'cuda': no CUDA device is visible"):
        dist_utils.pick_device("cuda")
    assert dist_utils.pick_device("auto") == torch.device("cpu")


def test_local_rank_beyond_the_visible_gpus_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK 2 but only 2 CUDA devices"):
        dist_utils.pick_device("auto")


def test_destroy_skips_the_barrier_while_an_error_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    barriers = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1))
    for failing in (False, True):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            try:
                if failing:
                    raise ConfigError("bad line in this rank's shard")
            finally:
                dist_utils.destroy_distributed()
        except ConfigError:
            pass
        assert not dist.is_initialized()
    assert barriers == [1]  # only the clean exit waited for its peers
