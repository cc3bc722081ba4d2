"""Async tensor parallel: sequence parallel's collectives micro-pipelined with their matmuls.

Under sequence parallel every block all-gathers its normed input over the tp ranks before the
column-split matmuls (wq / wk / wv, gate / up) and reduce-scatters the row-split matmuls'
partial sums (wo, down) after them, and each waits for the other. Inductor's micro-pipeline
pass (`torch._inductor.config._micro_pipeline_tp`) rewrites each all-gather -> matmul and
matmul -> reduce-scatter it finds in a compiled graph into one fused op over CUDA symmetric
memory, which splits the exchange into one chunk per rank and computes on each chunk as it
arrives (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter). So it needs
the blocks compiled (config rules), CUDA devices, and symmetric memory set up for the tp group:
without that the pass finds the patterns and leaves them unfused, without a word.

The setting is Inductor's, process-wide, as in torchtitan; it must be on before the blocks'
first compiled call (parallelize_qwen3 applies it with TP, before compile). The memory
estimator models the synchronous form (estimator/estimate.py says so in its notes).
"""

import torch._inductor.config as inductor_config
from torch.distributed._symmetric_memory import enable_symm_mem_for_group
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_ablate.config import ConfigError

KEY = "parallelism.enable_async_tensor_parallel = true"


def apply_async_tp(tp_mesh: DeviceMesh, device_type: str) -> None:
    """Turns on Inductor's micro-pipeline TP pass and symmetric memory for `tp_mesh`'s group."""
    if device_type != "cuda":
        raise ConfigError(
            f"{KEY} needs CUDA devices (its fused collectives use CUDA symmetric memory); set "
            "it to false on CPU"
        )
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    inductor_config._micro_pipeline_tp = True
