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


def _vote(plan: list[tuple[bool, bool]]) -> list[list[bool]]:
    """Each (raise on rank 1, now) in turn; rank 1's first flag stays raised once raised (as a
    signal's does), its second only at the call that raises it (as rank 0's verdict)."""
    vote, raised, answers = dist_utils.AnyRankLater(torch.device("cpu")), False, []
    for up, now in plan:
        raised |= up and dist.get_rank() == 1
        answers.append(vote([raised, up and dist.get_rank() == 1], now))
    return answers


def test_any_rank_later_answers_a_step_late_unless_now() -> None:
    from tests.helpers.distributed import run_distributed

    plan = [(False, False), (True, False), (False, False), (False, True), (False, False)]
    plan += [(True, True), (False, False)]
    ranks = run_distributed(_vote, 2, plan)
    assert ranks[0] == ranks[1]  # every rank decides alike
    assert ranks[0] == [
        [False, False],  # nothing queued before the first call
        [False, False],  # step 1's vote: rank 1 raises both at step 2, not yet read
        [True, True],  # step 2's, read a step late
        [True, False],  # `now`: this step's
        [False, False],  # read at the `now` step above: nothing from it is answered twice
        [True, True],  # `now` sees a flag raised at this very step
        [False, False],
    ]
    one_process = dist_utils.AnyRankLater(torch.device("cpu"))
    assert one_process([True, False], now=False) == [True, False]  # the flags themselves


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_any_rank_later_reads_cuda_values_behind_the_queued_work() -> None:
    """CUDA's path (pinned copies both ways, an event): each answer is the flags of the call it
    answers, though the GPU is still busy with work queued after that call."""
    vote = dist_utils.AnyRankLater(torch.device("cuda"))
    vote.alone = False  # as on several ranks; one process skips the all-reduce itself
    busy = torch.randn(4096, 4096, device="cuda")
    answers = []
    for flags, now in [([True, False], False), ([False, True], False), ([False, False], True)]:
        answers.append(vote(flags, now))
        for _ in range(20):  # queued after this call's vote: the next answer need not wait
            busy = busy @ busy / busy.norm()
    assert answers == [[False, False], [True, False], [False, False]]
