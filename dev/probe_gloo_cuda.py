"""Which collectives gloo runs on CUDA tensors when several processes share one GPU.

    python3 dev/probe_gloo_cuda.py [--world 2]

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo stages CUDA tensors through
the host for some collectives. Where it does for every collective a layout uses, that layout's
per-rank CUDA memory can be measured on a one-GPU machine (each process has its own caching
allocator). Prints one line per collective: ok, or the error's first line.
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _checks(rank: int, world: int) -> dict:
    dev = torch.device("cuda", 0)

    def all_reduce():
        t = torch.full((4,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        assert t[0].item() == sum(range(1, world + 1)), t

    def all_gather_into_tensor():
        out = torch.empty(4 * world, device=dev)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=dev))
        assert out.view(world, 4)[:, 0].tolist() == list(map(float, range(world))), out

    def reduce_scatter_tensor():
        out = torch.empty(4, device=dev)
        dist.reduce_scatter_tensor(out, torch.ones(4 * world, device=dev))
        assert out[0].item() == world, out

    def all_to_all_single_uneven():
        splits = [r + 1 for r in range(world)]  # rank r sends r+1 rows to every rank
        inp = torch.full(((rank + 1) * world,), float(rank), device=dev)
        out = torch.empty(sum(splits), device=dev)
        dist.all_to_all_single(out, inp, [splits[rank]] * world, splits)
        assert out.tolist() == [float(r) for r in range(world) for _ in range(r + 1)], out

    def send_recv():
        t = torch.full((4,), float(rank), device=dev)
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            assert t[0].item() == 0.0, t

    def broadcast():
        t = torch.full((4,), float(rank), device=dev)
        dist.broadcast(t, 0)
        assert t[0].item() == 0.0, t

    def bf16_all_gather():
        out = torch.empty(4 * world, device=dev, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.ones(4, device=dev, dtype=torch.bfloat16))

    results = {}
    for fn in (
        all_reduce,
        all_gather_into_tensor,
        reduce_scatter_tensor,
        all_to_all_single_uneven,
        send_recv,
        broadcast,
        bf16_all_gather,
    ):
        print(f"rank {rank}: {fn.__name__}", flush=True)
        try:
            fn()
            torch.cuda.synchronize()
            results[fn.__name__] = "ok"
        except Exception as e:  # noqa: BLE001 - the probe reports every failure
            results[fn.__name__] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        dist.barrier()
    return results


def _rank(rank: int, world: int, store_path: str, out) -> None:
    torch.cuda.set_device(0)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out.put((rank, _checks(rank, world)))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, os.path.join(tmp, "s"), out))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
    for name, status in results[0].items():
        print(f"{name:26s} rank0: {status} | rank1: {results[1][name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
