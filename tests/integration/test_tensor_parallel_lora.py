"""LoRA under tensor parallel on gloo ranks trains like the one-process LoRA run (fp32): each
split linear's adapter is split with it (distributed/lora_tensor_parallel.py: A replicated on
the column-split ones, B on the row-split ones), the base weights stay frozen and bit-equal,
and the adapters train as one process's within the layouts' tolerances (assert_same_training:
losses 1e-5 relative, weights 1e-4). TP 2 (2 ranks) and TP 2 x FSDP 2 (4 ranks), the dense
model and the MoE model (adapters on attention and on the routed experts, which TP leaves
whole). A TP 2 LoRA checkpoint resumes on one process like the uninterrupted run, and its PEFT
export equals the one-process run's.

The debug models are untied and narrowed to dim 64 (tests/helpers/pipeline_runs.py).
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_harness import assert_same_training
from tests.helpers.pipeline_runs import NARROW_ARGS, Case
from tests.helpers.pipeline_runs import train_narrow_cases as _runs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

LORA = ["--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8"]
ARGS = NARROW_ARGS + LORA
MOE = ARGS + ["--model.flavor", "debugmodel_moe", "--model.moe_aux_loss_coef", "0"]
MOE += ["--lora.target_modules", "q_proj,o_proj,experts"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
CKPT = ARGS + ["--checkpoint.enable", "--checkpoint.interval", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tp_lora"))


@pytest.fixture(scope="module")
def tp2(root) -> list[dict]:
    cases: list[Case] = [("dense", ARGS + TP2, None), ("moe", MOE + TP2, None)]
    cases += [("ckpt", CKPT + TP2, None)]
    return run_distributed(_runs, 2, root, cases, timeout_s=300)


@pytest.fixture(scope="module")
def one(root, tp2) -> dict:
    cases: list[Case] = [("dense", ARGS, None), ("moe", MOE, None), ("ckpt_one", CKPT, None)]
    cases += [("resume_one", CKPT, "ckpt")]
    return run_distributed(_runs, 1, root, cases)[0]


def _assert_lora_matches(got: dict, ref: dict) -> None:
    assert_same_training(got, ref)
    params = ref["params"]
    assert any(".lora_b" in k for k in params)
    for k in params:
        if ".lora_" not in k:  # frozen on both: the initial weights, bit for bit
            assert torch.equal(got["params"][k], params[k]), k
        elif ".lora_b" in k:  # trained away from 0
            assert params[k].abs().max() > 0, k


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_tp2_lora_matches_single_process(tp2, one, model):
    assert tp2[0][model]["losses"] == tp2[1][model]["losses"]
    _assert_lora_matches(tp2[0][model], one[model])


def test_tp2_fsdp2_lora_matches_single_process(root, one):
    out = run_distributed(_runs, 4, root, [("fsdp2", ARGS + TP2, None)], timeout_s=300)
    assert all(o["fsdp2"]["losses"] == out[0]["fsdp2"]["losses"] for o in out)
    _assert_lora_matches(out[0]["fsdp2"], one["dense"])


def test_tp2_lora_checkpoint_resumes_and_exports_as_one_process(root, tp2, one):
    whole = tp2[0]["ckpt"]
    after_step1 = {"losses": whole["losses"][1:], "params": whole["params"]}
    assert_same_training(one["resume_one"], after_step1)

    def peft(run: str) -> dict:
        step = Path(root, run, "checkpoint", "step-3")
        out = Path(root, f"{run}_peft")
        convert_checkpoint.main(["--to", "hf", str(step), str(Path(root, f"{run}_hf"))] + [
            "--dtype", "float32", "--peft", str(out)
        ])  # fmt: skip
        return load_file(out / "adapter_model.safetensors")

    got, want = peft("ckpt"), peft("ckpt_one")
    assert got.keys() == want.keys() and any("layers.3." in k for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4)
