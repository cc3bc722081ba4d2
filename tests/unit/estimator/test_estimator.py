"""The memory estimator: runs for every layout, writes its JSON, refuses bad input, and agrees
with real CPU runs measured by the same tracker."""

import glob
import json
import subprocess
import sys

import pytest

from tests.helpers.estimator_checks import assert_estimate_matches_ranks
from tests.helpers.estimator_configs import DENSE, INTENDED_WORLD_SIZE, MOE, _config
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.estimator import estimate, estimate_main

CP2 = ["--parallelism.context_parallel_degree", "2"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize(
    "base, world_size, extra",
    [
        (DENSE, 4, []),
        (DENSE, 2, ["--activation_checkpoint.mode", "full"]),
        (DENSE, 2, ["--activation_checkpoint.mode", "selective"]),
        (DENSE, 2, CP2),
        (DENSE, 2, ["--float8.enable", "true"]),
        (MOE, 2, ["--parallelism.expert_parallel_degree", "2"]),
        (DENSE, 4, HSDP),
        (MOE, 4, ["--parallelism.expert_parallel_degree", "2", *TP2]),
    ],
    ids=["fsdp4", "ac_full", "ac_selective", "cp2", "float8", "ep2", "hsdp", "moe_tp2_ep2"],
)
def test_estimate_runs(base, world_size, extra):
    est = estimate(_config(base, world_size, *extra))
    cats = est["by_category"]
    assert est["peak_gib"] > 0 and cats["parameters"] > 0 and cats["optimizer_states"] > 0
    assert abs(sum(cats.values()) - est["peak_gib"]) < 1e-6


def test_layouts_move_memory_where_they_should():
    fsdp2, fsdp4 = estimate(_config(DENSE, 2)), estimate(_config(DENSE, 4))
    cp2, hsdp = estimate(_config(DENSE, 2, *CP2)), estimate(_config(DENSE, 4, *HSDP))
    # CP splits each sequence over its ranks: fewer tokens' activations per rank than dp 2.
    assert cp2["by_category"]["activations"] < fsdp2["by_category"]["activations"]
    # HSDP shards over 2 of 4 ranks and replicates: twice FSDP-4's share of the weights.
    shard4, shard2 = fsdp4["by_category"]["parameters"], hsdp["by_category"]["parameters"]
    assert shard2 == pytest.approx(2 * shard4, rel=0.05), (shard2, shard4)


def test_ac_full_saves_activation_memory():
    none = estimate(_config(DENSE, 2))
    full = estimate(_config(DENSE, 2, "--activation_checkpoint.mode", "full"))
    assert full["by_category"]["activations"] < none["by_category"]["activations"]


def test_chunked_loss_is_estimated_smaller():
    # 2048 tokens x the debug vocab (2048): the float32 logits and their gradient are a large
    # share of the peak (0.20 GiB plain, 0.16 chunked).
    base = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "256"]
    base += ["--training.local_batch_size", "8"]
    plain = estimate(_config(base, 2, "--training.loss_chunk_size", "0"))
    chunked = estimate(_config(base, 2, "--training.loss_chunk_size", "256"))
    assert chunked["peak_bytes"] < plain["peak_bytes"]


def test_float8_all_gather_weights_are_counted():
    # torchao wraps each fp32 shard in a subclass for the float8 all-gather; the wrapper owns no
    # storage, so the parameters once vanished from the estimate (4B: 1.5 instead of 15 GiB).
    float8 = ["--float8.enable", "true", "--float8.enable_fsdp_float8_all_gather", "true"]
    plain = estimate(_config(DENSE, 2))["by_category"]
    wrapped = estimate(_config(DENSE, 2, *float8))["by_category"]
    assert wrapped["parameters"] == plain["parameters"]
    assert wrapped["optimizer_states"] == plain["optimizer_states"]


def test_ep_imbalance_raises_the_busiest_rank():
    # Batch 8, so the backward's activations (not the step's end) set the peak.
    ep = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "8"]
    base = estimate(_config(MOE, 2, *ep))
    skewed = estimate(_config(MOE, 2, *ep, "--memory_estimation.ep_imbalance", "2"))
    assert skewed["peak_bytes"] > base["peak_bytes"]
    assert "2x" in skewed["ranks"][0]["assumption"]


def test_json_schema(tmp_path, capsys):
    out = tmp_path / "est.json"
    estimate_main(_config(DENSE, 2, "--memory_estimation.output", str(out)))
    doc = json.loads(out.read_text())
    for key in ("world_size", "device_memory_gib", "peak_gib", "fits", "by_category", "ranks"):
        assert key in doc
    assert doc["world_size"] == 2 and doc["fits"] is True
    assert "fits in 80 GiB" in capsys.readouterr().out


def test_does_not_fit_suggests_knobs(capsys, tmp_path):
    out_json = tmp_path / "est.json"
    base = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "256"]
    # 0.6 GiB: above the model state and the CUDA context (0.56 GiB), below the peak.
    base += ["--training.local_batch_size", "8", "--memory_estimation.device_memory_gib", "0.6"]
    estimate_main(_config(base, 1, "--memory_estimation.output", str(out_json)))
    out = capsys.readouterr().out
    assert "does not fit" in out and "try --activation_checkpoint.mode full" in out
    doc = json.loads(out_json.read_text())
    # Only changes that lower the peak (one more rank would add NCCL's context here); a
    # smaller micro-batch keeps the global batch.
    assert doc["suggestions"] and all(s["peak_gib"] < doc["peak_gib"] for s in doc["suggestions"])
    assert [s["change"] for s in doc["suggestions"]] == [
        "--activation_checkpoint.mode full",
        "--training.local_batch_size 4 --training.global_batch_size 8 "
        "(same global batch: gradient accumulation)",
    ]


def test_does_not_fit_below_the_model_state_offers_no_batch_or_recomputation(capsys):
    # The model state (0.06 GiB) and the CUDA context (0.5 GiB) alone exceed 0.52 GiB.
    estimate_main(_config(DENSE, 1, "--memory_estimation.device_memory_gib", "0.52"))
    out = capsys.readouterr().out
    assert "no batch size or activation checkpointing removes them" in out
    assert "--activation_checkpoint" not in out and "--training.local_batch_size" not in out


def test_bad_input_is_one_line_exit_2():
    cmd = [sys.executable, "estimation.py", *DENSE, "--memory_estimation.world_size", "3"]
    cmd += ["--parallelism.context_parallel_degree", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "context_parallel_degree" in proc.stderr


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--parallelism.fsdp_cpu_offload", "true"], "fsdp_cpu_offload"),
    ],
)
def test_unsupported_option_is_a_config_error(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        estimate(_config(DENSE, 2, *extra))


TOKENS = ["--parallelism.expert_parallel_dispatch", "tokens"]


@pytest.mark.parametrize(
    "base, extra",
    [
        (DENSE, []),
        (MOE, ["--parallelism.expert_parallel_degree", "2"]),
        (MOE, ["--parallelism.expert_parallel_degree", "2", *TOKENS]),
        (DENSE, TP2),
        (MOE, TP2),
        (DENSE, [*TP2, "--lora.enable", "true"]),
    ],
    ids=["fsdp2_dense", "ep2_moe", "ep2_moe_tokens", "tp2_dense", "tp2_moe", "tp2_lora"],
)
def test_estimate_matches_real_cpu_ranks(base, extra):
    config = _config(base, 2, *extra)
    predicted = estimate(config, target="cpu")["peak_bytes"]
    assert_estimate_matches_ranks(config, predicted, every=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("toml", sorted(glob.glob("train_configs/*.toml")))
def test_shipped_tomls_estimate(toml):
    # At the world size each recipe is written for (its header comment); real widths, experts,
    # vocab, sequence and degrees; 4 blocks instead of up to 94 keep the whole suite inside CI's
    # 15 minutes (per-block memory is the same for every block).
    name = toml.split("/")[-1][: -len(".toml")]
    assert name in INTENDED_WORLD_SIZE, f"{toml}: add its intended world size to this test"
    world_size = INTENDED_WORLD_SIZE[name]
    config = _config(["--job.config_file", toml, "--model.n_layers", "4"], world_size)
    est = estimate(config)
    assert est["peak_gib"] > 0 and est["world_size"] == world_size


def test_attention_stand_in_writes_out_in_the_query_layout():
    # Flex, flash and cuDNN write out in q's memory layout: the model's [B, S, H, K] projection
    # viewed as [B, H, S, K]. The stand-in must too, or the transpose back for the output
    # projection becomes a copy saved for backward (+6.4% on the 0.6B recipe, 28 blocks).
    import torch

    from torchtitan_ablate.estimator.cuda_model import _fused_attention

    q_BHSK = torch.empty(2, 16, 8, 4).transpose(1, 2)  # [B, S, H, K] storage
    kv_BJSK = torch.empty(2, 16, 2, 4).transpose(1, 2)
    out_BHSK, lse_BHS, _ = _fused_attention(q_BHSK, kv_BJSK, kv_BJSK, None)
    assert out_BHSK.shape == (2, 8, 16, 4) and lse_BHS.shape == (2, 8, 16)
    assert out_BHSK.stride() == q_BHSK.stride()
    assert out_BHSK.transpose(1, 2).is_contiguous()  # reshape to [B, S, H * K] is a view


def test_async_tp_is_estimated_as_tp_and_says_so():
    """Inductor's micro-pipeline pass runs on CUDA only: the GPU estimate models TP's own
    collectives (the fused ops gather into a buffer of the same size) and notes it; the CPU
    run, which the cpu target estimates, refuses async TP in one line."""
    args = [*TP2, "--compile.enable", "true", "--parallelism.enable_async_tensor_parallel", "true"]
    config = _config(DENSE, 2, *args)
    est, plain = estimate(config), estimate(_config(DENSE, 2, *args[:-2]))
    assert est["peak_bytes"] == plain["peak_bytes"]
    assert "async TP modelled as TP" in " ".join(est["notes"])
    with pytest.raises(ConfigError, match=r"enable_async_tensor_parallel = true needs CUDA"):
        estimate(config, target="cpu")
