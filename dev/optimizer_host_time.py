"""Host time of one AdamW step over Qwen3-0.6B (FSDP on one GPU, fused): torch's AdamW on
DTensors vs LocalShardAdamW, twice each.

    torchrun --standalone --nproc_per_node 1 dev/optimizer_host_time.py
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan_ablate.components.optim.optimizer import LocalShardAdamW
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model


def median_ms(xs: list[float]) -> float:
    xs = sorted(xs[5:])
    return xs[len(xs) // 2] * 1e3


dist.init_process_group("nccl")
torch.cuda.set_device(0)
mesh = init_device_mesh("cuda", (1,))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
with torch.device("cuda"):
    model = Qwen3Model(qwen3_flavors["0.6B"])
for block in model.layers.values():
    fully_shard(block, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
params = list(model.parameters())
for p in params:
    p.grad = torch.zeros_like(p)
print(f"{len(params)} parameter tensors, {torch.cuda.get_device_name(0)}")
for cls in (torch.optim.AdamW, LocalShardAdamW, torch.optim.AdamW, LocalShardAdamW):
    opt = cls(params, lr=1e-4, weight_decay=0.1, fused=True)
    host, total = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - start)
    print(
        f"| {cls.__name__} | host {median_ms(host):.2f} ms | host+GPU {median_ms(total):.2f} ms |"
    )
dist.destroy_process_group()
