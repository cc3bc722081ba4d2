"""Causal attention kernels at a model's training shape: forward and forward+backward time.

    python scripts/bench_attention.py [--model qwen3] [--flavor 0.6B] [--batch 4] [--seq 4096]
        [--reps 10]

Each variant computes the same causal GQA attention on the same random bf16 inputs; its output
and gradients are checked against the first variant (relative error), then timed with CUDA
events (median of --reps after warm-up). TFLOP/s counts the causal work only (half the square).
Needs CUDA.
"""

import argparse

from torchtitan_ablate.config.job_config import Model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=Model.name, help="model family (as model.name)")
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    return parser


if __name__ == "__main__":  # --help and a wrong option answer before torch's imports (seconds)
    build_parser().parse_args()

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.models.common import attention as attn
from torchtitan_ablate.models.registry import get_spec


def _sdpa_backend(backend: SDPBackend, repeat_kv: bool, contiguous: bool):
    def fn(q_BSHK, k_BSJK, v_BSJK):
        if repeat_kv:
            q_BSHK, k_BSJK, v_BSJK = attn._repeat_kv(q_BSHK, k_BSJK, v_BSJK)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSJK, v_BSJK))
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat_kv)
        return out.transpose(1, 2)

    return fn


def _engine_backend(name: str):
    def fn(q_BSHK, k_BSJK, v_BSJK):
        batch, seq_len = q_BSHK.shape[:2]
        mask = attn.build_attention_mask(name, None, batch, seq_len, q_BSHK.device)
        return attn.attention(q_BSHK, k_BSJK, v_BSJK, mask)

    return fn


VARIANTS = {
    "engine sdpa (cuDNN first, repeated kv)": _engine_backend("sdpa"),
    "cudnn, repeated kv, BHSK contiguous": _sdpa_backend(SDPBackend.CUDNN_ATTENTION, True, True),
    "flash (FA2), gqa": _sdpa_backend(SDPBackend.FLASH_ATTENTION, False, False),
    "flash (FA2), repeated kv": _sdpa_backend(SDPBackend.FLASH_ATTENTION, True, False),
    "efficient, gqa": _sdpa_backend(SDPBackend.EFFICIENT_ATTENTION, False, False),
    "engine flex (compiled)": _engine_backend("flex"),
    "engine varlen": _engine_backend("varlen"),
}


def _time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        flavors = get_spec(args.model).flavors
    except ConfigError as e:
        parser.error(str(e))
    if args.flavor not in flavors:
        parser.error(f"--flavor {args.flavor}: one of {', '.join(flavors)}")
    m = flavors[args.flavor]
    B, S, H, J, K = args.batch, args.seq, m.n_heads, m.n_kv_heads, m.head_dim
    torch.manual_seed(0)
    q = torch.randn(B, S, H, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, J, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, J, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, S, H, K, device="cuda", dtype=torch.bfloat16)
    flops_fwd = 4 * B * H * S * S * K / 2  # causal: half of the QK^T and PV products
    print(f"{args.flavor}: B={B} S={S} H={H} J={J} K={K}, torch {torch.__version__}")
    print("| variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | rel err out / dq |")
    print("|---|---|---|---|---|---|")
    ref = None
    for name, fn in VARIANTS.items():
        try:
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v)
            out.backward(grad)
            got = (out.detach(), q.grad.detach().clone())
            ref = ref or got
            err = f"{_rel(got[0], ref[0]):.1e} / {_rel(got[1], ref[1]):.1e}"

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd(fn=fn):
                fn(q, k, v).backward(grad)

            t_f, t_fb = _time_ms(fwd, args.reps), _time_ms(fwd_bwd, args.reps)
            tf, tfb = flops_fwd / t_f / 1e9, 3.5 * flops_fwd / t_fb / 1e9
            print(f"| {name} | {t_f:.2f} | {tf:.0f} | {t_fb:.2f} | {tfb:.0f} | {err} |")
        except Exception as e:  # a backend that refuses this shape is a result, not a crash
            print(f"| {name} | - | - | - | - | {type(e).__name__}: {str(e)[:80]} |")


if __name__ == "__main__":
    main()
