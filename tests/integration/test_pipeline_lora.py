"""LoRA under pipeline parallel on gloo ranks trains like the one-process LoRA run (fp32): each
part's blocks carry their adapters, the base weights stay frozen, and a rank's optimizer holds
its parts' adapters only. Per-step losses and validation losses within 1e-5 relative, final
adapters within 1e-4, base weights bit-equal; 1F1B (one part per rank) and ZBVZeroBubble (two,
each backward split into input and weight passes over the frozen weights).

A checkpoint of an Interleaved1F1B LoRA run (each rank saves its parts' adapters and their
moments under the whole model's names) resumes on one process like the uninterrupted run, and
its exports, the merged HF model (checkpoint.last_save_in_hf) and the PEFT adapters
(scripts/convert_checkpoint.py --peft), equal the one-process run's.

Three process groups, each training its configs in turn: 2 ranks (the PP runs), 1 rank (the
references and the resume), 4 ranks (PP 2 x FSDP 2). The debug model is untied and narrowed to
dim 64 (tests/helpers/pipeline_runs.py); LoRA on a randomly initialised model: B starts at 0,
the adapters move at the first step.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import NARROW_ARGS, VAL, Case
from tests.helpers.pipeline_runs import train_narrow_cases as _runs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

P = "--parallelism."
LORA = ["--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8"]
ARGS = NARROW_ARGS + LORA
PP2 = [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_microbatch_size", "2"]
SCHEDULES = ("1F1B", "ZBVZeroBubble")
HF = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32"]
CKPT = ARGS + ["--checkpoint.enable", "--checkpoint.interval", "1", *HF]
INTERLEAVED = [P + "pipeline_parallel_schedule", "Interleaved1F1B"]
ZBV = [P + "pipeline_parallel_schedule", "ZBVZeroBubble"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp_lora"))


@pytest.fixture(scope="module")
def pp2(root) -> list[dict]:
    cases: list[Case] = [
        (s, ARGS + VAL + PP2 + [P + "pipeline_parallel_schedule", s], None) for s in SCHEDULES
    ]
    cases += [("ckpt", CKPT + PP2 + INTERLEAVED, None)]
    return run_distributed(_runs, 2, root, cases, timeout_s=300)


@pytest.fixture(scope="module")
def one(root, pp2) -> dict:
    """The one-process LoRA run (validating), the same with checkpoints, and the one-process
    resume of the PP 2 checkpoint."""
    cases: list[Case] = [("reference", ARGS + VAL, None), ("ckpt_one", CKPT, None)]
    cases += [("resume_one", CKPT, "ckpt")]
    return run_distributed(_runs, 1, root, cases)[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_lora_matches_single_process(pp2, one, schedule):
    for key in ("losses", "validation"):
        assert pp2[0][schedule][key] == pp2[1][schedule][key]
    got, ref = pp2[0][schedule], one["reference"]
    assert_same_training(got, ref)
    params = ref["params"]
    assert any(".lora_a" in k for k in params) and "layers.3.attention.wq.lora_b" in params
    for k in params:
        if ".lora_" not in k:  # frozen on both: the initial weights, bit for bit
            assert torch.equal(got["params"][k], params[k]), k
        elif ".lora_b" in k:  # trained away from 0
            assert params[k].abs().max() > 0, k


def test_pp2_fsdp2_lora_matches_single_process(root, one):
    """PP 2 x FSDP 2 (4 ranks, 4 sequences per dp rank; ZBVZeroBubble): each part's frozen and
    trainable weights sharded together over its 2 dp ranks, as without PP."""
    args = ARGS + VAL + PP2 + ZBV + ["--training.local_batch_size", "4"]
    out = run_distributed(_runs, 4, root, [("fsdp2", args, None)])
    for key in ("losses", "validation"):
        assert all(o["fsdp2"][key] == out[0]["fsdp2"][key] for o in out)
    assert_same_training(out[0]["fsdp2"], one["reference"])


def test_pp2_lora_checkpoint_resumes_and_exports_as_one_process(root, pp2, one):
    whole = pp2[0]["ckpt"]
    after_step1 = {"losses": whole["losses"][1:], "params": whole["params"]}
    assert_same_training(one["resume_one"], after_step1)
    assert_same_training(whole, one["ckpt_one"])

    def exports(run: str) -> tuple[dict, dict]:
        step = Path(root, run, "checkpoint", "step-3")
        peft = Path(root, f"{run}_peft")
        convert_checkpoint.main(["--to", "hf", str(step), str(Path(root, f"{run}_hf"))] + [
            "--dtype", "float32", "--peft", str(peft)
        ])  # fmt: skip
        return load_file(step / "hf" / "model.safetensors"), load_file(
            peft / "adapter_model.safetensors"
        )

    pp_exports = exports("ckpt")
    for got, want in zip(pp_exports, exports("ckpt_one"), strict=True):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4)
    merged, adapters = pp_exports
    assert "lm_head.weight" in merged and not any("lora" in k for k in merged)
    assert any("layers.0." in k for k in adapters) and any("layers.3." in k for k in adapters)
