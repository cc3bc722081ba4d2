"""JobConfig: every knob of a run, one dataclass per TOML section.

Section and key names follow torchtitan where it has them. Each field's docstring is the
reference text (`scripts/config_reference.py` turns them into docs/config_reference.md).
"""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan_ablate.config.checkpoint_config import Checkpoint
from torchtitan_ablate.config.comm_config import Comm
from torchtitan_ablate.config.debug_config import Debug
from torchtitan_ablate.config.dpo_config import DPO
from torchtitan_ablate.config.measure_config import (
    MemoryEstimation,
    Metrics,
    Profiling,
    Validation,
)
from torchtitan_ablate.config.optim_config import LRScheduler, Optimizer
from torchtitan_ablate.config.parallelism_config import Parallelism


@dataclass
class Job:
    config_file: str | None = None
    """TOML file with this run's settings (CLI overrides it, it overrides defaults)."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: config.toml, metrics.jsonl, tb/, checkpoints."""

    description: str = ""
    """Free text shown in logs and reports."""


@dataclass
class Model:
    name: str = "qwen3"
    """Model family, one registered in models/registry.py (built in: qwen3, dense and MoE)."""

    flavor: str = "debugmodel"
    """Size preset from models/qwen3/args.py: debugmodel, debugmodel_moe, 0.6B, 1.7B, 4B, 8B,
    14B, 32B, 30B-A3B, 235B-A22B; or "auto": the sizes of the config.json in
    checkpoint.initial_load_path (an HF folder, or a DCP folder written by
    scripts/convert_checkpoint.py)."""

    tokenizer_path: str = "assets/tokenizer/debug.tiktoken"
    """Tokenizer: a tiktoken ranks file, an HF tokenizer.json, a sentencepiece .model, a folder
    holding one of them, or "byte" (byte-level, for tests). Set by neither the recipe nor the
    command line while checkpoint.initial_load_format = "hf": the tokenizer of the HF folder
    checkpoint.initial_load_path (one without a tokenizer is refused)."""

    attn_backend: Literal["auto", "sdpa", "flex", "varlen", "flash"] = "auto"
    """Attention kernel. auto: flex on CUDA (fastest measured in training,
    docs/performance.md), sdpa elsewhere. flex and varlen honour packed-document
    boundaries without a dense mask; flash needs the flash-attn package. With
    context_parallel_degree > 1 only auto is accepted: context parallel runs its own attention
    (compiled flex on CUDA, SDPA with a dense mask on CPU)."""

    moe_aux_loss_coef: float = -1.0
    """MoE load-balancing loss coefficient; -1 keeps the flavor's value (0.001 for Qwen3 MoE).
    MoE flavors only (dense flavors accept -1 and 0)."""

    moe_bias_update_rate: float = 0.0
    """Aux-loss-free balancing: per-step update rate of the expert selection bias (0 = off;
    MoE flavors only)."""

    vocab_size: int = -1
    """Override the flavor's vocabulary size (-1 keeps it); must cover the tokenizer."""

    n_layers: int = -1
    """Override the flavor's number of transformer blocks (-1 keeps it), e.g. to fit a large
    flavor's layer shapes on one GPU."""

    num_experts: int = -1
    """Override the number of routed experts of a MoE flavor (-1 keeps it; top-k is kept)."""


@dataclass
class Training:
    dataset: Literal["synthetic", "text", "chat", "preference"] = "text"
    """synthetic: seeded random tokens; text: .txt / .jsonl ({"text": ...}) files in
    dataset_path; chat: .jsonl ({"messages": [{"role", "content"}, ...]}) rendered in Qwen's
    chat format, loss only on assistant tokens (SFT, see docs/finetuning.md); preference:
    .jsonl ({"prompt", "chosen", "rejected"}) trained with DPO (the [dpo] section)."""

    dataset_path: str | list[str] | None = "assets/data/debug_corpus.jsonl"
    """File or folder for dataset = "text" (.txt/.jsonl/.parquet) or "chat"; text: a list of
    them is a mixture, each document drawn from path i with probability dataset_weights[i]. On
    the command line a mixture is its paths separated by commas (--training.dataset_path
    web.jsonl,code.parquet --training.dataset_weights 0.7,0.3); a comma inside a path is
    written \\, ('odd\\,name.jsonl'), and an unescaped one in the name of an existing path is
    refused with that hint."""

    dataset_weights: list[float] = field(default_factory=list)
    """Mixture weights, one per dataset_path entry, normalized (empty = equal); seeded by seed."""

    synthetic_doc_len: int = 0
    """Tokens per document of dataset = "synthetic", its EOS included; 0: random lengths in
    [1, 2 * seq_len] (plus EOS), so a row holds one document or the tails of two. seq_len
    makes every row exactly one whole document: the same attention work in every step, for
    throughput studies of long sequences."""

    dataset_text_field: str = "text"
    """JSONL key / parquet column holding a document's text (validation data too)."""

    shuffle_buffer: int = 0
    """Documents in a seeded shuffle buffer (0 = file order); the checkpoint holds the buffer.
    A resume with another size skips and repeats no document (a bigger saved buffer's extra
    documents come first)."""

    packing: Literal["greedy", "best_fit", "padding"] = "greedy"
    """greedy: documents joined in order, attention masked per document (text: cut at row ends,
    EOS between documents; chat: a conversation never split, a row closes when the next one does
    not fit); best_fit (chat only): each conversation goes into the open row it fills best
    (fewer padding tokens); padding: one document per row, pad tokens ignored by the loss."""

    data_sharding: Literal["documents", "rows"] = "documents"
    """How data-parallel ranks split the data (text and synthetic datasets). documents: each
    rank reads and packs its own documents (torchtitan's way; a step's data depends on the dp
    degree). rows: every rank reads and packs every document and keeps its slice of each global
    batch (Megatron's way): the same global batches at any dp degree, so layouts and GPU counts
    are compared on identical data; tokenization is repeated on every rank and loader worker."""

    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; a multiple of local_batch_size * dp degree
    gives gradient accumulation. -1 = local_batch_size * dp degree (no accumulation)."""

    seq_len: int = 256
    """Tokens per sequence."""

    steps: int = 50
    """Optimizer steps to train (derived instead when epochs is set)."""

    epochs: float | None = None
    """Run length in passes over the data (HF's num_train_epochs): training.steps = ceil(epochs
    x the data's size / what a step consumes), counted once at start-up (docs/from_hf.md says
    what is counted). Text or chat/preference data only; set it or steps, not both in one
    place (the command line overrides the recipe's)."""

    max_norm: float = 1.0
    """Gradient clipping by global L2 norm (0 = off)."""

    skip_nonfinite_steps: int = 0
    """A step whose loss or gradient norm is NaN/Inf never updates the weights. 0: the run
    stops there (one line, exit code 3, nothing saved after it; with the fused optimizer the
    check is read once the next step is queued); K > 0: up to K such steps in a row are skipped
    (logged; the LR schedule moves on), the next one stops the run."""

    loss_chunk_size: int = 8192
    """Tokens per chunk of the fused output-projection + cross-entropy (no [B, S, V] logits
    for the whole batch; same value and gradients). The default: on one H100, Qwen3-0.6B at
    batch 8 x 4096 peaks at 54 instead of 65 GiB at the same tokens/s
    (docs/performance.md). 0 = plain loss on full logits (with loss_impl auto)."""

    loss_impl: Literal["auto", "chunked", "plain", "liger", "cce"] = "auto"
    """Cross-entropy implementation. auto: chunked when loss_chunk_size > 0, else plain;
    chunked: this engine's, loss_chunk_size tokens at a time; plain: on the full logits;
    liger / cce: Liger-Kernel's fused linear cross-entropy / Apple's cut cross-entropy (CUDA,
    pip install -e .[liger] / .[cce]), each with its package's defaults: cce's loss is exact,
    its gradients approximate (gradient filter, bf16 sums; bf16 training only;
    docs/performance.md); loss_chunk_size applies to chunked only."""

    throughput_warmup_steps: int = 5
    """Steps left out of the steady-state tokens/s (compile, allocator warm-up): the noise
    stop and the metrics.comm_profile window start after them."""

    throughput_noise_target: float = 0.0
    """Stop cleanly (final checkpoint, exit 0) once the median tokens/s of the logged steps
    after throughput_warmup_steps is known within this fraction (half-width of its 95%
    confidence interval / median, over the logged values: metrics.log_freq = 1 logs each step;
    docs/ablation.md); training.steps is the budget. 0 = off."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter/compute dtype on GPU. CPU runs use float32 unless cpu_mixed_precision."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks. bfloat16 needs FSDP, which is
    applied with more than one rank or bf16 parameters."""

    cpu_mixed_precision: bool = False
    """Also use mixed_precision_param on CPU (default: float32 on CPU for exactness)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: CUDA when available, else CPU (gloo between processes)."""

    seed: int = 42
    """Seed for weights, synthetic data, dropout, the data mixture and shuffle buffer; same
    seed, same run."""

    deterministic: bool = False
    """Ask torch for deterministic kernels (slower on GPU)."""

    exit_at_step: int = -1
    """Save a checkpoint and exit cleanly after this step (at most training.steps) without
    changing the LR schedule (time-limited jobs); -1 = off."""

    sigterm_grace_seconds: float = 120.0
    """On SIGTERM the run stops and saves at the end of the step in flight (several ranks: of
    the next one; their vote is read a step late); a step that has not ended this many seconds
    after the signal or its start (a hang) ends the process with one line, exit code 143,
    nothing saved. Keep it below the scheduler's grace before SIGKILL, less two steps and a
    save; 0 = no limit."""

    num_workers: int = 0
    """Data-loader worker processes per rank. A resume with another value continues the data
    exactly between 0 and 1, and at any value with data_sharding = "rows"; with "documents"
    sharding each worker reads its own documents, so it is refused (resume with the old value)."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC off in between)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block), selective."""

    selective_ac_option: str = "2"
    """For selective: an integer n (checkpoint every n-th block) or "op" (save matmul outputs,
    recompute the rest)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss)."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model, loss (at least one when enable is true)."""


@dataclass
class Float8:
    enable: bool = False
    """Train Linear layers in float8 (torchao; needs SM89+ GPUs)."""

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 scaling recipe; rowwise_with_gw_hp keeps the weight-gradient GEMM in bf16
    (more accurate than rowwise, a little slower). Tensor parallel takes tensorwise only."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Linear modules whose names contain one of these stay in high precision (so do linears
    whose dimensions are not multiples of 16)."""

    moe: bool = False
    """Also run routed experts in float8 through torchao's grouped-GEMM path."""


# lora.target_modules: HF projection name -> the module it adapts inside a transformer block
# (models/common/lora.py); "experts" is every routed expert's gate/up/down, per expert.
LORA_TARGETS = {
    "q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv",
    "o_proj": "attention.wo", "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2", "experts": "moe.experts",
}  # fmt: skip


@dataclass
class LoRA:
    enable: bool = False
    """Train low-rank adapters on frozen base weights (no gradients or optimizer state for the
    base); merged into the base weights on export (scripts/convert_checkpoint.py --to hf)."""

    rank: int = 16
    """Adapter rank r: each target W [out, in] gets A [r, in] and B [out, r] (B starts at 0)."""

    alpha: float = 32.0
    """Scale: the adapter adds (alpha / rank) * B @ A to the weight."""

    dropout: float = 0.0
    """Dropout on the adapter's input (0 = off)."""

    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ]
    )  # fmt: skip
    """Projections to adapt, by HF name: q_proj, k_proj, v_proj, o_proj (attention), gate_proj,
    up_proj, down_proj (dense MLP), experts (every routed expert's gate/up/down, per expert)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    lora: LoRA = field(default_factory=LoRA)
    dpo: DPO = field(default_factory=DPO)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    debug: Debug = field(default_factory=Debug)
