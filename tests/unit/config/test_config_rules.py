"""The rules of config/rules.py, each through load_config: a value out of range or a
combination that cannot run is one line naming the key; the values at the edges load. Also the
import direction: config imports nothing from the packages that use it."""

import ast
import re
from pathlib import Path

import pytest

import torchtitan_ablate.config as config_package
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.job_config import LORA_TARGETS

LORA = ["--lora.enable", "true"]
FLOAT8 = ["--float8.enable", "true"]
EXIT = ["--checkpoint.enable", "true", "--training.steps", "5", "--training.exit_at_step"]


@pytest.mark.parametrize(
    "args, key",
    [
        (["--training.gc_freq", "0"], "training.gc_freq"),
        (["--training.gc_freq", "-3"], "training.gc_freq"),
        (["--training.max_norm", "-1"], "training.max_norm"),
        (["--training.loss_chunk_size", "-1"], "training.loss_chunk_size"),
        (["--training.num_workers", "-1"], "training.num_workers"),
        (["--lr_scheduler.min_lr_factor", "-0.1"], "lr_scheduler.min_lr_factor"),
        (["--lr_scheduler.min_lr_factor", "1.5"], "lr_scheduler.min_lr_factor"),
        (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k"),
        (EXIT + ["6"], "training.exit_at_step"),
        (["--metrics.peak_tflops", "0"], "metrics.peak_tflops"),
        (["--metrics.peak_tflops", "-2"], "metrics.peak_tflops"),
        (["--memory_estimation.device_memory_gib", "0"], "memory_estimation.device_memory_gib"),
        (["--memory_estimation.device_memory_gib", "-5"], "memory_estimation.device_memory_gib"),
        (["--memory_estimation.world_size", "0"], "memory_estimation.world_size"),
        (["--memory_estimation.ep_imbalance", "0.5"], "memory_estimation.ep_imbalance"),
        (["--optimizer.beta1", "1.0"], "optimizer.beta1"),
        (["--optimizer.beta1", "-0.1"], "optimizer.beta1"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2"),
        (["--optimizer.beta2", "-0.5"], "optimizer.beta2"),
        (["--optimizer.eps", "-1e-8"], "optimizer.eps"),
        (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
        (["--optimizer.lr", "0"], "optimizer.lr"),
        (["--validation.enable", "true"], "needs validation.dataset_path"),
        (["--validation.freq", "0"], "validation.freq"),
        (["--training.dataset", "synthetic", "--validation.dataset_path", "x"], "is not read"),
        (["--training.synthetic_doc_len", "64"], "does not make any"),
        (["--training.dataset", "synthetic", "--training.synthetic_doc_len", "-1"], "doc_len"),
        (["--validation.steps", "0"], "validation.steps"),
        (["--validation.local_batch_size", "0"], "validation.local_batch_size"),
        (LORA + ["--lora.rank", "0"], "lora.rank"),
        (LORA + ["--lora.alpha", "0"], "lora.alpha"),
        (LORA + ["--lora.alpha", "-16"], "lora.alpha"),
        (LORA + ["--lora.dropout", "1.0"], "lora.dropout"),
        (LORA + ["--lora.dropout", "-0.1"], "lora.dropout"),
        (LORA + ["--lora.target_modules", "q_proj,wq"], "lora.target_modules"),
        (LORA + ["--lora.target_modules", ""], "lora.target_modules"),
        (
            FLOAT8 + ["--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "float8.enable_fsdp_float8_all_gather",
        ),
        (FLOAT8 + ["--float8.moe", "true"], "float8.moe"),
        (FLOAT8 + ["--float8.moe", "true", "--float8.recipe", "rowwise_with_gw_hp"], "float8.moe"),
        (
            ["--training.dataset", "chat", "--training.data_sharding", "rows"],
            "training.data_sharding",
        ),
        (["--compile.enable", "true", "--compile.components", ""], "compile.components"),
        (["--model.vocab_size", "0"], "model.vocab_size"),
        (["--model.n_layers", "0"], "model.n_layers"),
        (["--model.n_layers", "-5"], "model.n_layers"),
        (["--model.num_experts", "-2"], "model.num_experts"),
        (["--model.moe_aux_loss_coef", "-0.5"], "model.moe_aux_loss_coef"),
        (["--model.moe_bias_update_rate", "-0.01"], "model.moe_bias_update_rate"),
        (
            ["--parallelism.context_parallel_degree", "2", "--model.attn_backend", "sdpa"],
            "model.attn_backend",
        ),
        (
            ["--parallelism.context_parallel_degree", "2", "--model.attn_backend", "flex"],
            "model.attn_backend",
        ),
    ],
)
def test_out_of_range_values_are_rejected(args, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as e:
        load_config(args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args",
    [
        ["--training.max_norm", "0"],  # 0 = no clipping
        ["--training.loss_chunk_size", "0"],  # plain loss
        ["--checkpoint.keep_latest_k", "0"],  # keep all
        ["--lr_scheduler.min_lr_factor", "1"],
        EXIT + ["5"],
        ["--optimizer.beta1", "0", "--optimizer.eps", "0", "--optimizer.weight_decay", "0"],
        ["--metrics.peak_tflops", "500", "--memory_estimation.device_memory_gib", "141"],
        LORA + ["--lora.rank", "1", "--lora.target_modules", "q_proj,experts"],
        ["--lora.rank", "0"],  # LoRA off: its settings are not used
        FLOAT8 + ["--float8.recipe", "rowwise", "--float8.moe", "true"],
        FLOAT8 + ["--float8.enable_fsdp_float8_all_gather", "true"],
        ["--float8.moe", "true"],  # float8 off
        ["--compile.components", ""],  # compile off
        ["--parallelism.context_parallel_degree", "2"],  # attn_backend auto
        ["--model.flavor", "debugmodel_moe", "--model.n_layers", "1", "--model.num_experts", "4"],
        ["--model.vocab_size", "4096", "--model.moe_aux_loss_coef", "0"],
    ],
)
def test_boundary_values_are_accepted(args):
    load_config(args)


DENSE_NAMES = [t for t in LORA_TARGETS if t != "experts"]


@pytest.mark.parametrize(
    "args, message",
    [
        (LORA + ["--lora.rank", "0"], "lora.rank = 0: must be >= 1"),
        (LORA + ["--lora.dropout", "1.5"], "lora.dropout = 1.5: must be in [0, 1)"),
        (
            LORA + ["--lora.target_modules", "q_projj"],
            f"lora.target_modules = ['q_projj']: choose one or more of {list(LORA_TARGETS)}",
        ),
        (LORA + ["--lora.target_modules", ""], "lora.target_modules = []: choose one or more of"),
        (
            FLOAT8 + ["--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "float8.enable_fsdp_float8_all_gather = true needs float8.recipe = 'tensorwise' "
            "(got 'rowwise'): rowwise scales cannot be computed before the all-gather",
        ),
        (
            FLOAT8 + ["--float8.moe", "true"],
            "float8.moe = true needs float8.recipe = 'rowwise' (got 'tensorwise'): torchao's "
            "float8 grouped GEMM for experts is rowwise only",
        ),
        (
            FLOAT8 + ["--float8.recipe", "fp4"],
            "float8.recipe = 'fp4' is not valid; expected one of 'tensorwise', 'rowwise', "
            "'rowwise_with_gw_hp'",
        ),
    ],
)
def test_lora_and_float8_messages(args, message):
    # The one home of these rules: apply_lora and apply_float8 take their settings as checked.
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert message in str(e.value)


TOKENS = ["--parallelism.expert_parallel_dispatch", "tokens"]


def test_token_dispatch_rules():
    with pytest.raises(ConfigError) as e:
        load_config(TOKENS)
    message = "expert_parallel_dispatch = 'tokens' needs parallelism.expert_parallel_degree > 1"
    assert message + " (it is 1)" in str(e.value)
    # With EP it loads, LoRA on the experts included (every dispatcher runs every compute).
    ep_tokens = TOKENS + ["--parallelism.expert_parallel_degree", "2"] + LORA
    for targets in ("q_proj,v_proj", "q_proj,experts"):
        config = load_config(ep_tokens + ["--lora.target_modules", targets])
        assert config.parallelism.expert_parallel_dispatch == "tokens"


TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--parallelism.enable_async_tensor_parallel", "true"],
            "parallelism.enable_async_tensor_parallel = true needs "
            "parallelism.tensor_parallel_degree > 1 (it is 1)",
        ),
        (
            ["--parallelism.enable_async_tensor_parallel", "true"]
            + ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "false"],
            "parallelism.enable_async_tensor_parallel = true needs the blocks compiled "
            "(compile.enable = true, 'model' in compile.components)",
        ),
        (["--parallelism.tensor_parallel_degree", "0"], "tensor_parallel_degree = 0: must be >= 1"),
        (
            TP2 + FLOAT8 + ["--float8.recipe", "rowwise"],
            "parallelism.tensor_parallel_degree = 2 with float8.recipe = 'rowwise' is not "
            "supported: torchao's float8 tensor parallel styles are tensorwise only",
        ),
        (TP2 + FLOAT8 + ["--float8.recipe", "rowwise_with_gw_hp"], "'rowwise_with_gw_hp' is not"),
        (
            TP2 + ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"],
            "parallelism.tensor_parallel_degree = 2; the seed checkpoint is written by one process",
        ),
    ],
)
def test_tensor_parallel_rules(args, message):
    # Model sizes and MoE are checked where the flavor is known (ParallelDims.check_model).
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_loads_with_what_it_supports():
    args = TP2 + ["--activation_checkpoint.mode", "full", "--compile.enable", "true"]
    config = load_config(args + ["--parallelism.data_parallel_replicate_degree", "2"])
    assert config.parallelism.tensor_parallel_degree == 2
    assert load_config(TP2 + FLOAT8).float8.recipe == "tensorwise"  # float8 TP: tensorwise
    assert load_config(TP2 + LORA).lora.enable  # adapters split with their linears
    dpo = ["--training.dataset", "preference", "--training.dataset_path", "x.jsonl"]
    assert load_config(TP2 + dpo).parallelism.tensor_parallel_degree == 2  # pair sums over tp
    config = load_config(TP2 + ["--parallelism.context_parallel_degree", "2"])
    assert config.parallelism.context_parallel_degree == 2
    async_tp = ["--parallelism.enable_async_tensor_parallel", "true", "--compile.enable", "true"]
    assert load_config(TP2 + async_tp).parallelism.enable_async_tensor_parallel  # CUDA: at build
    # MoE: attention by TP, experts by EP over the ranks of one tp coordinate.
    moe = ["--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"]
    assert load_config(TP2 + moe).parallelism.expert_parallel_degree == 2


def test_default_lora_targets_are_the_dense_projections():
    assert load_config([]).lora.target_modules == DENSE_NAMES


def test_config_imports_only_config():
    # The dependency runs models / distributed / components -> config, never back.
    folder = Path(config_package.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            inside = [n for n in names if n.startswith("torchtitan_ablate")]
            bad = [n for n in inside if not n.startswith("torchtitan_ablate.config")]
            assert not bad, f"{path.name} imports {bad}"


def test_text_field_is_for_text_data_only():
    with pytest.raises(ConfigError, match="training.dataset_text_field = 'body' names the field"):
        load_config(["--training.dataset", "synthetic", "--training.dataset_text_field", "body"])
