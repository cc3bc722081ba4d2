"""Throughput benchmark: N timed training steps after warm-up, one table row per model.

    python scripts/bench.py --job.config_file train_configs/qwen3_0.6b.toml [--section.key v ...]
        [--steps 10] [--warmup 3] [--peer hf] [--peer-compile] [--peer-bf16-weights]
        [--profile [--trace FILE]] [--bench-corpus [DIR]]

Times the engine's own train step (same build path as training) and, with --peer hf,
Hugging Face transformers' model of the same shape in the same process and the same way
(bf16 autocast over fp32 weights, AdamW, SDPA, same batches; --peer-bf16-weights: pure bf16),
then prints the ratio.
Results also go to <job.dump_folder>/bench.json. Several GPUs (expert / data parallel layouts):
    torchrun --standalone --nproc_per_node 4 scripts/bench.py --job.config_file ... [--profile]
(the figures are rank 0's; tokens/s per GPU; the peer runs on one GPU only).
--profile: after timing, profiles 2 engine steps and prints the GPU time by kernel class
(matmul, attention, elementwise/fused, copies, optimizer, collectives), the top kernels, and the
share of the window the GPU sat idle (host-bound time), the operators by own GPU time, and
where host syncs come from; --trace FILE[.gz] also writes the profiled steps' chrome trace
(rank 0). --bench-corpus: scripts/make_bench_corpus.py's data and tokenizer (outputs/bench_corpus).
"""

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from typing import Any

from torchtitan_ablate.components.text.bench_corpus import DEFAULT_OUT, with_corpus


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The bench's own options, and the rest (the config's --section.key value)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peer", choices=["hf"], default=None)
    parser.add_argument("--peer-compile", action="store_true")
    parser.add_argument("--peer-bf16-weights", action="store_true", help="peer in pure bf16")
    parser.add_argument("--profile", action="store_true", help="kernel-class breakdown")
    parser.add_argument("--trace", help="with --profile: rank 0's chrome trace here (.gz ok)")
    parser.add_argument("--bench-corpus", nargs="?", const=DEFAULT_OUT, metavar="DIR")
    args, rest = parser.parse_known_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: timed steps, at least 1")
    if args.trace and not args.profile:
        parser.error("--trace writes the profiled steps' trace: add --profile")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: warm-up steps, 0 or more")
    return args, rest


if __name__ == "__main__":  # --help and a wrong option answer before torch's imports (seconds)
    parse_args(sys.argv[1:])

from torchtitan_ablate.cuda_allocator import ALLOC_CONF  # noqa: E402

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # the trainer's, before CUDA starts

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchtitan_ablate.build import build_data, build_layout, build_run
from torchtitan_ablate.components.observability.comm_profile import exposed_and_idle, is_gpu_kernel
from torchtitan_ablate.components.observability.metrics import device_peak_tflops
from torchtitan_ablate.components.observability.profiling import print_sync_sites
from torchtitan_ablate.config import JobConfig, exit_on_config_error, load_config
from torchtitan_ablate.distributed import utils as dist_utils
from torchtitan_ablate.library_warnings import filter_library_warnings
from torchtitan_ablate.models.registry import state_dict_adapter
from torchtitan_ablate.step import next_micro_batches, train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step_fn, batches, warmup: int, steps: int, device: torch.device) -> dict:
    for i in range(warmup):
        step_fn(batches[i % len(batches)])
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)
    start = time.perf_counter()
    for i in range(steps):
        step_fn(batches[i % len(batches)])
    _sync(device)
    elapsed = time.perf_counter() - start
    out = {"step_time_s": elapsed / steps}
    if device.type == "cuda":
        out["memory_max_active_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["memory_max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        # Near the memory limit the caching allocator frees and retries (each a device sync).
        after = torch.cuda.memory_stats(device)
        out["allocator_per_step"] = {
            k: (after.get(k, 0) - before.get(k, 0)) / steps
            for k in ("num_alloc_retries", "num_device_free", "num_sync_all_streams")
        }
    return out


def bench_engine(
    config: JobConfig, warmup: int, steps: int, profile_: bool = False, trace: str | None = None
) -> tuple[dict, list, Any]:
    """Timed (and optionally profiled) steps of the engine; the result row, the micro-batches
    and the model sizes of the run."""
    device = dist_utils.pick_device(config.training.device)
    world_size = dist_utils.init_distributed(device)
    layout = build_layout(config, world_size, device.type)
    _, dataloader = build_data(config, layout, device)
    run = build_run(config, layout, device)
    data_iter = iter(dataloader)
    batches = [next_micro_batches(data_iter, run, device) for _ in range(min(4, warmup + steps))]

    def step_fn(micro_batches: list[dict]) -> dict:
        return train_step(run, micro_batches)

    result = _time_steps(step_fn, batches, warmup, steps, device)
    if profile_:
        result["profile"] = profile_engine(step_fn, batches, device, trace=trace)
    tokens = sum(b["input_ids"].numel() for b in batches[0])
    result.update(name="torchtitan_ablate", tokens_per_step=tokens)
    return result, batches, layout.model_args


KERNEL_CLASSES = (  # first match wins; names as CUDA kernels appear in the profiler
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("collective", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "_mm_", "matmul")),
    # Before copy/cast: inductor names fused kernels after their ops ("..._to_copy_add_...").
    ("triton (fused)", ("triton",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "fill")),
)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense")


def _kernel_class(name: str) -> str:
    lower = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in lower for k in keys):
            return cls
    return "other elementwise"


def profile_engine(
    step_fn, batches, device: torch.device, top: int = 20, trace: str | None = None
) -> dict:
    """GPU time by kernel class over 2 steps, and the idle share of the window; `trace`: rank 0
    also writes the two steps' chrome trace there (gzipped when it ends in .gz)."""
    _sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step_fn(batches[i % len(batches)])
        _sync(device)
    wall_us = (time.perf_counter() - start) * 1e6
    if trace and int(os.environ.get("RANK", 0)) == 0:
        prof.export_chrome_trace(trace)  # gzipped by torch when the name ends in .gz
        print(f"trace: {trace}")
    per_kernel: dict[str, float] = {}
    comm, compute = [], []
    for e in prof.events():
        if is_gpu_kernel(e):
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us()
            interval = (e.time_range.start, e.time_range.end)
            (comm if _kernel_class(e.name) == "collective" else compute).append(interval)
    # Idle inside the kernels' own window (first start to last end), so the profiler's start and
    # stop overhead is not counted as host-bound time. Collective kernels also count the time
    # they wait for the slowest rank; "exposed" is the part of it no compute kernel overlaps.
    kernels = comm + compute  # none on CPU: the operator table below still holds
    window = max(e for _, e in kernels) - min(s for s, _ in kernels) if kernels else 0.0
    split = exposed_and_idle(comm, compute, window)
    busy, exposed = split["busy_us"], split["exposed_us"]
    by_class: dict[str, float] = {}
    for name, us in per_kernel.items():
        by_class[_kernel_class(name)] = by_class.get(_kernel_class(name), 0.0) + us
    total = sum(per_kernel.values()) or 1.0
    print(
        f"profile: 2 steps, wall {wall_us / 1e3:.1f} ms, GPU busy {100 * busy / wall_us:.1f}%, "
        f"exposed collectives {exposed / 2e3:.1f} ms / step, "
        f"GPU idle {split['idle_us'] / 2e3:.1f} ms / step"
    )
    print("| kernel class | ms / step | share of GPU time |")
    print("|---|---|---|")
    for cls, us in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"| {cls} | {us / 2e3:.2f} | {100 * us / total:.1f}% |")
    print("| kernel | ms / step | share |")
    print("|---|---|---|")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {name[:90]} | {us / 2e3:.2f} | {100 * us / total:.1f}% |")
    # Which operators launched the time (kernels are charged to the innermost op), and the
    # host syncs that leave the GPU idle while the CPU catches up.
    ops = [a for a in prof.key_averages() if a.device_type == DeviceType.CPU]
    print("| operator (own GPU time) | ms / step | calls / step |")
    print("|---|---|---|")
    for a in sorted(ops, key=lambda a: -a.self_device_time_total)[:top]:
        print(f"| {a.key[:70]} | {a.self_device_time_total / 2e3:.2f} | {a.count / 2:g} |")
    syncs = {a.key: a.count / 2 for a in ops if a.key in SYNC_EVENTS}
    print(f"host syncs per step: {syncs or 'none'}")
    if device.type == "cuda":
        print_sync_sites(step_fn, batches[0])
    return {
        "wall_ms_per_step": wall_us / 2e3,
        "gpu_busy_frac": busy / wall_us,
        "exposed_collectives_ms_per_step": exposed / 2e3,
        "ms_per_step_by_class": {k: v / 2e3 for k, v in by_class.items()},
    }


def bench_hf(
    config: JobConfig,
    model_args: Any,
    batches: list,
    warmup: int,
    steps: int,
    compile_: bool,
    bf16_weights: bool = False,
) -> dict:
    """transformers' model of the same shape (the config.json the family's state-dict adapter
    writes): bf16 autocast over fp32 weights (as its Trainer's
    bf16=True), or with bf16_weights pure bf16 weights, gradients and AdamW states (what its
    compiled MoE needs for the grouped_mm experts kernel; it falls back to a per-expert loop
    for fp32 weights under torch.compile); AdamW, SDPA."""
    import transformers

    hf_config = state_dict_adapter(model_args).hf_config()
    device = batches[0][0]["input_ids"].device
    cls_name = hf_config["architectures"][0]
    hf_cfg = transformers.AutoConfig.for_model(**hf_config)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(config.training.seed)
    model = getattr(transformers, cls_name)(hf_cfg).to(device)
    if bf16_weights:
        model.to(torch.bfloat16)
    model.train()
    forward = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, fused=device.type == "cuda")
    autocast = not bf16_weights and (device.type == "cuda" or config.training.cpu_mixed_precision)

    def step(micro_batches: list[dict]) -> None:
        for b in micro_batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = forward(input_ids=b["input_ids"], labels=b["input_ids"])
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = f"hf_{cls_name}" + ("_compiled" if compile_ else "") + ("_bf16" if bf16_weights else "")
    try:
        result = _time_steps(step, batches, warmup, steps, device)
    except torch.OutOfMemoryError:
        print(f"{name}: out of memory at this batch; compare at a smaller local_batch_size")
        return None
    tokens = sum(b["input_ids"].numel() for b in batches[0])
    result.update(name=name, tokens_per_step=tokens)
    return result


def _row(r: dict, flops_per_token: float, peak: float | None) -> dict:
    tps = r["tokens_per_step"] / r["step_time_s"]
    tflops = tps * flops_per_token / 1e12
    return {**r, "tps": tps, "tflops": tflops, "mfu": 100 * tflops / peak if peak else 0.0}


def main(argv: list[str]) -> list[dict]:
    args, rest = parse_args(argv)
    # Checked before the engine's benchmark, which would otherwise run only to fail afterwards.
    if args.peer == "hf" and importlib.util.find_spec("transformers") is None:
        print("bench: --peer hf needs transformers: pip install transformers", file=sys.stderr)
        raise SystemExit(2)
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun rank 0 prints the tables
        sys.stdout = open(os.devnull, "w")
    with exit_on_config_error():
        rest, corpus = with_corpus(args.bench_corpus, rest)
        config = load_config(rest)
        engine, batches, model_args = bench_engine(
            config, args.warmup, args.steps, args.profile, args.trace
        )
    device = batches[0][0]["input_ids"].device
    world_size = torch.distributed.get_world_size()
    flops = model_args.num_flops_per_token(config.training.seq_len)
    peak = device_peak_tflops(device, config.metrics.peak_tflops)
    rows = [_row(engine, flops, peak)]
    if args.peer == "hf" and world_size > 1:
        print("bench: --peer hf runs on one GPU (no torchrun); skipped", file=sys.stderr)
    elif args.peer == "hf":
        gc.collect()  # the engine's model and optimizer state go before the peer is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = bench_hf(config, model_args, batches, args.warmup, args.steps, args.peer_compile,
                      args.peer_bf16_weights)  # fmt: skip
        if hf is not None:
            rows.append(_row(hf, flops, peak))
            rows[-1]["engine_speedup"] = rows[0]["tps"] / rows[-1]["tps"]
    print(f"data: {corpus or config.training.dataset_path}")
    print("| model | tokens/s/GPU | TFLOP/s | MFU % | step s | active / reserved GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mem = (
            f"{r['memory_max_active_gib']:.1f} / {r['memory_max_reserved_gib']:.1f}"
            if "memory_max_active_gib" in r
            else "n/a (cpu)"
        )
        print(
            f"| {r['name']} | {r['tps']:,.0f} | {r['tflops']:.1f} | {r['mfu']:.1f} | "
            f"{r['step_time_s']:.3f} | {mem} |"
        )
    if len(rows) > 1:
        print(f"engine / {rows[-1]['name']}: {rows[-1]['engine_speedup']:.2f}x tokens/s")
    for r in rows:
        if "allocator_per_step" in r:
            print(f"allocator per step ({r['name']}): {r['allocator_per_step']}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(config.job.dump_folder, exist_ok=True)
        with open(os.path.join(config.job.dump_folder, "bench.json"), "w") as f:
            json.dump(dict(config=config.job.config_file, corpus=corpus, rows=rows), f, indent=1)
    dist_utils.destroy_distributed()
    return rows


if __name__ == "__main__":
    filter_library_warnings()
    main(sys.argv[1:])
