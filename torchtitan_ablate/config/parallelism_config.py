"""The [parallelism] section: the degrees of each parallelism and their settings. Field
docstrings are the reference text, as in job_config.py; key names are torchtitan's."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas (HSDP's outer dimension, or plain data parallel)."""

    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 = the ranks left over by the other degrees."""

    context_parallel_degree: int = 1
    """Ranks a sequence is split over."""

    expert_parallel_degree: int = 1
    """Ranks routed experts are split over (borrowed from dp_shard * cp)."""

    expert_parallel_dispatch: Literal["rows", "tokens"] = "rows"
    """How expert parallel moves tokens: rows sends each token once per chosen expert (top_k
    rows); tokens sends it once to each rank holding one of its experts and sums there (as
    DeepEP; 2.2x fewer bytes at top-8 of 128 experts over 4 ranks)."""

    tensor_parallel_degree: int = 1
    """Ranks each layer's weights are split over (tensor parallel with sequence parallel, the
    innermost mesh dimension). Dense and MoE models (MoE layers are not split: each tp rank
    routes its own tokens); must divide n_heads, n_kv_heads, hidden_dim (of dense layers),
    vocab_size and training.seq_len / context_parallel_degree (each cp rank's sequence)."""

    enable_async_tensor_parallel: bool = False
    """Async TP: torch.compile's micro-pipeline pass splits sequence parallel's all-gathers and
    reduce-scatters into per-rank chunks that overlap the matmuls they feed or drain (CUDA
    symmetric memory). Needs tensor_parallel_degree > 1, the blocks compiled and CUDA GPUs."""

    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 offload).
    CUDA only, and FSDP must be applied: more than one rank or bf16 parameters."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """never keeps gathered parameters until backward (ZeRO-2-like; under gradient accumulation
    until the step's last backward); always frees them after forward (ZeRO-3); default = always
    except the last block, whose backward starts at once, and never under pipeline parallel (as
    torchtitan: each micro-batch's forward would gather again). The final norm and output head (and
    the tied table) stay gathered until backward in every mode. always needs FSDP (more than one
    rank or bf16 parameters)."""

    pipeline_parallel_degree: int = 1
    """Ranks the layers are split over (pipeline parallel, the outermost mesh dimension); 1 =
    off. Each rank holds one or more model parts: consecutive blocks, the
    first part also the embedding, the last the final norm and output head. Models with untied
    embeddings only (8B and larger flavors, 30B-A3B); MoE also with expert parallel (each
    part's experts split over the ep ranks of its own pp slice); with context parallel each
    part takes its cp rank's training.seq_len / context_parallel_degree tokens, with tensor
    parallel (dense and MoE) its weights are split over the tp ranks of its pp slice."""

    pipeline_parallel_schedule: Literal[
        "1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"
    ] = "1F1B"
    """The order the micro-batches' forwards and backwards run in. 1F1B and GPipe: one model
    part per rank; Interleaved1F1B, InterleavedZeroBubble (looped) and ZBVZeroBubble (V-shaped:
    a rank holds the first and the last part): several parts per rank (2 unless
    pipeline_parallel_layers_per_stage says otherwise). InterleavedZeroBubble and ZBVZeroBubble
    split each backward into an input and a weight pass: they need torch 2.13 or newer, and
    refuse fsdp_reshard_after_forward = always."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch: each loader batch (training.local_batch_size
    sequences, which it must divide) is cut into local_batch_size / this micro-batches."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per model part; the embedding and the final norm + output head each
    count as one block. None: 1 part per rank (single-part schedules) or 2 (the others), the
    blocks split evenly. Ignored when module_fqns_per_model_part is set."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Module names of each model part, in pipeline order, e.g. [["tok_embeddings",
    "layers.0"], ["layers.1", "norm", "output"]]: every block once and in order, tok_embeddings
    in the first part, norm and output in the last; a multiple of pipeline_parallel_degree
    parts. None: the split of pipeline_parallel_layers_per_stage."""
