"""Expert load of this engine's Qwen3 MoE against torchtitan 0.2.2's on CPU, at step 0 (30B-A3B
widths) and over a few steps (small widths), on the peer's corpus: dev/routing_study.md.

    python dev/routing_study.py step0 --tt-site /tmp/tt_site
    python dev/routing_study.py train --tt-site /tmp/tt_site

--tt-site: torchtitan 0.2.2 and its pure-Python wheels (`pip install --no-deps --target DIR
<peer>/whl/*.whl`, torch excepted); without triton an empty stand-in is put on sys.path (its CPU
path never runs the kernel). Ids: a document of the peer's corpus generator (--peer, default
../shared/peers/torchtitan beside the checkout), tokenised as the `tokenizers` package does.

step0: one block at a time at 30B-A3B widths, each engine's own init_weights (variants set the
embedding and router std; the embedding drawn for the tokenizer's 8192 ids), the same ids into
both; prints each MoE layer's max/mean expert load and the router inputs' mean cosine similarity.
train: both engines with AdamW, the peer's lr and warm-up, bias or aux-loss balancing; prints the
mean over layers of max/mean expert load per step.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_ablate.components.text.tokenizer import build_tokenizer
from torchtitan_ablate.models.common.attention import build_attention_mask
from torchtitan_ablate.models.common.init import ParamInit
from torchtitan_ablate.models.qwen3.args import qwen3_flavors
from torchtitan_ablate.models.qwen3.model import Qwen3Model, rope_cos_sin
from torchtitan_ablate.models.qwen3.model import TransformerBlock as OurBlock

PEER = (
    Path(__file__).resolve().parents[2] / "shared" / "peers" / "torchtitan"
)  # beside the checkout
N_IDS = 8192  # the peer tokenizer's ids
TT_NAMES = {"moe_hidden_dim": "moe_inter_dim"}
SMALL = dict(dim=512, n_heads=8, n_kv_heads=4, head_dim=128, moe_hidden_dim=64)


def import_torchtitan(site: str, peer: Path):
    """torchtitan's Qwen3 flavors and model module from `site` (and the peer's `datasets`)."""
    sys.path[:0] = [site, str(peer / "py")]
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = Path(tempfile.mkdtemp()) / "triton"
        stub.mkdir()
        (stub / "__init__.py").write_text("def jit(fn=None, **kw):\n    return fn\n")
        (stub / "language.py").write_text("constexpr = int\n")
        sys.path.insert(0, str(stub.parent))
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.models.qwen3.model import model as tt_model

    return qwen3_args, tt_model


@contextmanager
def float_histc() -> Iterator[None]:
    """torchtitan counts expert ids with torch.histc on int64, which CPU lacks: float32 here."""
    histc = torch.histc
    torch.histc = lambda x, *args, **kw: histc(x.float(), *args, **kw).to(x.dtype)
    try:
        yield
    finally:
        torch.histc = histc


def peer_token_ids(peer: Path, n_tokens: int) -> torch.Tensor:
    """The first n_tokens ids of one peer-corpus document (its generator, seed 0)."""
    out = Path(tempfile.mkdtemp()) / "corpus.jsonl"
    cmd = [sys.executable, str(peer / "make_corpus.py"), "--out", str(out), "--docs", "1"]
    subprocess.run(cmd + ["--words-per-doc", str(max(2000, n_tokens))], check=True)
    text = json.loads(out.read_text().splitlines()[0])["text"]
    ids = build_tokenizer(str(peer / "assets" / "tokenizer")).encode(text)
    return torch.tensor(ids[:n_tokens])


def imbalance(tokens_E: torch.Tensor) -> float:
    return (tokens_E.max() / tokens_E.mean()).item()


def cosine_collapse(x_TD: torch.Tensor) -> float:
    """Mean pairwise cosine similarity of the rows (diagonal included), from their mean."""
    return F.normalize(x_TD.double(), dim=-1).mean(0).square().sum().item()


def depth_std(block: nn.Module) -> float:
    """0.02 / sqrt(2 (layer + 1)), under each engine's name."""
    return block.init_std if hasattr(block, "init_std") else block.weight_init_std


def set_router(block: nn.Module, router_std: float | str, unit_EDs: torch.Tensor) -> None:
    """router_std: 'own' keeps the init; 'depth' or a number scales the unit draw unit_EDs."""
    if router_std != "own":
        std = depth_std(block) if router_std == "depth" else router_std
        block.moe.router.gate.weight.data.copy_(unit_EDs * std)


def unit_draw(like: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return nn.init.trunc_normal_(torch.empty_like(like), 0, 1, -3, 3, generator=gen)


class Blocks:
    """One engine's n_layers 30B-A3B blocks, one at a time (2.4 GB of experts each); tt: None
    builds ours."""

    def __init__(self, n_layers: int, seq: int, qwen3_args=None, tt_model=None) -> None:
        self.tt, self.name = tt_model, "ours" if tt_model is None else "tt"
        if tt_model is None:
            self.args = replace(qwen3_flavors["30B-A3B"], n_layers=n_layers, max_seq_len=seq)
            self.rope = rope_cos_sin(self.args.head_dim, seq, self.args.rope_theta)
        else:
            self.args = replace(qwen3_args["30B-A3B"], n_layers=n_layers, max_seq_len=seq)
            self.args.moe_args = replace(self.args.moe_args, use_grouped_mm=False)
            self.rope = tt_model.precompute_rope_cache(
                self.args.head_dim, seq, self.args.rope_theta
            )

    def block(self, layer_id: int, seed: int, with_experts: bool) -> nn.Module:
        """Layer `layer_id` by its engine's init_weights, except the routed experts: plain
        normals of the same stds (w1 0.02, w2/w3 the depth std in both engines; drawing 600M
        truncated values takes minutes on a shared CPU), undrawn when they never run."""
        with torch.device("meta"):
            block = (
                OurBlock(layer_id, self.args)
                if self.tt is None
                else self.tt.TransformerBlock(layer_id, self.args)
            )
        block.to_empty(device="cpu")
        experts = block.moe.experts
        experts.init_weights = lambda *args, **kwargs: None
        torch.manual_seed(seed + layer_id)
        with torch.no_grad():
            if self.tt is None:
                block.init_weights(ParamInit(block, seed + layer_id))
            else:
                block.init_weights(torch.device("cpu"))
            if with_experts:
                experts.w1.normal_(0.0, 0.02)
                experts.w2.normal_(0.0, depth_std(block))
                experts.w3.normal_(0.0, depth_std(block))
        return block

    def forward(self, block: nn.Module, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.tt is not None:
            with float_histc():
                return block(h_BSD, self.rope, None)
        batch, seq, _ = h_BSD.shape
        mask = build_attention_mask("sdpa", None, batch, seq, h_BSD.device)
        cos, sin = (t[:seq].expand(batch, seq, -1) for t in self.rope)
        return block(h_BSD, cos, sin, mask)


class _RouterSeen(Exception):
    """Raised at the experts of the last layer studied: its routing is known, its output unused."""


def stop_at_experts(_module: nn.Module, _args: tuple) -> None:
    raise _RouterSeen


@torch.no_grad()
def step0_loads(blocks: Blocks, ids_BS: torch.Tensor, variants: list, seed: int) -> list:
    """Per variant (embedding std, router std), per layer: (max/mean load, router cosine)."""
    table_VD = torch.randn(N_IDS, blocks.args.dim, generator=torch.Generator().manual_seed(seed))
    h_vBSD = [table_VD[ids_BS] * emb_std for emb_std, _ in variants]
    rows: list[list[tuple[float, float]]] = [[] for _ in variants]
    seen: dict[str, torch.Tensor] = {}  # the router's input, from a hook
    for layer_id in range(blocks.args.n_layers):
        start, last = time.time(), layer_id == blocks.args.n_layers - 1
        block = blocks.block(layer_id, seed, with_experts=not last)
        own_gate = block.moe.router.gate.weight.clone()
        unit_EDs = unit_draw(own_gate, seed + 1000 + layer_id)
        hooks = [block.moe.register_forward_pre_hook(lambda _m, a: seen.update(x=a[0]))]
        if last:
            hooks.append(block.moe.experts.register_forward_pre_hook(stop_at_experts))
        for v, (_, router_std) in enumerate(variants):
            block.moe.router.gate.weight.copy_(own_gate)
            set_router(block, router_std, unit_EDs)
            block.moe.tokens_per_expert.zero_()
            try:
                h_vBSD[v] = blocks.forward(block, h_vBSD[v])
            except _RouterSeen:
                pass
            x_TD = seen["x"].flatten(0, -2)
            rows[v].append((imbalance(block.moe.tokens_per_expert), cosine_collapse(x_TD)))
        for hook in hooks:
            hook.remove()
        print(f"  ({blocks.name} layer {layer_id}: {time.time() - start:.0f}s)", flush=True)
    return rows


# (engine, embedding std, router std). 'own': the engine's init; 'depth': the block's
# depth-scaled std (torchtitan's router init, and this project's); 0.02: the router init
# torchtitan_ablate had, with its 0.02 embedding.
LAYER0 = [
    ("ours", 0.02, 0.02), ("ours", 0.02, "depth"), ("ours", 0.1, "depth"),
    ("ours", 0.3, "depth"), ("ours", 1.0, 0.02), ("ours", 1.0, "depth"),
    ("tt", 1.0, "own"), ("tt", 1.0, 0.02), ("tt", 0.3, "own"), ("tt", 0.02, "own"),
]  # fmt: skip
DEEP = [("ours", 0.02, 0.02), ("ours", 1.0, "depth"), ("tt", 1.0, "own"), ("tt", 0.02, "own")]


def run_step0(a: argparse.Namespace) -> None:
    qwen3_args, tt_model = import_torchtitan(a.tt_site, Path(a.peer))
    ids_BS = peer_token_ids(Path(a.peer), a.batch * a.seq).view(a.batch, a.seq)
    print(f"step 0: 30B-A3B widths, batch {a.batch} x seq {a.seq}, seed {a.seed}")
    for n_layers, variants in ((1, LAYER0), (a.layers, DEEP)):
        print(f"\n{n_layers} layer(s)\nengine | emb std | router std | max/mean | router-input cos")
        for name, tt in (("ours", None), ("tt", tt_model)):
            blocks = Blocks(n_layers, a.seq, qwen3_args, tt)
            mine = [(e, r) for n, e, r in variants if n == name]
            for (emb_std, router_std), rows in zip(mine, step0_loads(blocks, ids_BS, mine, a.seed)):
                loads = " ".join(f"{r[0]:5.2f}" for r in rows)
                cos = " ".join(f"{r[1]:.2f}" for r in rows)
                print(f"{name} | {emb_std:g} | {router_std} | {loads} | {cos}", flush=True)


# name -> (engine, embedding std, router std, aux loss coefficient, bias update rate)
TRAIN_RUNS = {
    "tt": ("tt", "own", "own", 0.0, 1e-3),
    "ours_before": ("ours", 0.02, 0.02, 0.0, 1e-3),
    "ours_emb_only": ("ours", 1.0, 0.02, 0.0, 1e-3),
    "ours": ("ours", "own", "own", 0.0, 1e-3),
    "ours_before_aux": ("ours", 0.02, 0.02, 1e-3, 0.0),
    "ours_aux": ("ours", "own", "own", 1e-3, 0.0),
    "tt_none": ("tt", "own", "own", 0.0, 0.0),  # torchtitan 0.2.2's Qwen3 as it trains
    "ours_none": ("ours", "own", "own", 0.0, 0.0),
    "ours_1e-4": ("ours", "own", "own", 0.0, 1e-4),
}


def small_model(run: tuple, a: argparse.Namespace, tt) -> nn.Module:
    engine, emb_std, router_std, aux, rate = run
    dims = dict(SMALL, n_layers=a.layers, vocab_size=N_IDS, max_seq_len=a.seq)
    if engine == "ours":
        args = replace(qwen3_flavors["30B-A3B"], **dims, moe_aux_loss_coef=aux)
        args = replace(args, moe_bias_update_rate=rate, moe_grouped_mm=False)
        model = Qwen3Model(args)
        model.init_weights(init=ParamInit(model, a.seed))
    else:
        qwen3_args, tt_model = tt
        args = replace(qwen3_args["30B-A3B"])
        for key, value in dims.items():
            setattr(args, TT_NAMES.get(key, key), value)
        coeff = rate or None  # torchtitan's "off"
        args.moe_args = replace(args.moe_args, use_grouped_mm=False, load_balance_coeff=coeff)
        torch.manual_seed(a.seed)
        model = tt_model.Qwen3Model(args)
        with torch.no_grad():
            model.init_weights(torch.device("cpu"))
    with torch.no_grad():
        if emb_std != "own":
            model.tok_embeddings.weight.normal_(0.0, emb_std)
        for i, block in enumerate(model.layers.values()):
            set_router(block, router_std, unit_draw(block.moe.router.gate.weight, a.seed + i))
    return model


def train_loads(run: tuple, a: argparse.Namespace, ids: torch.Tensor, tt) -> list[float]:
    """Mean over layers of the max/mean load, per step."""
    model = small_model(run, a, tt)
    params = [p for p in model.parameters()]
    tt_opt = None
    if run[0] == "ours":
        opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
        groups = opt.param_groups
    else:  # torchtitan's own optimizer container, whose step pre-hook updates the bias
        from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
        from torchtitan.config.job_config import Optimizer
        from torchtitan.distributed.parallel_dims import ParallelDims

        pd = ParallelDims(1, 1, 1, 1, 1, 1, 1, world_size=1)
        config = Optimizer(lr=a.lr, implementation="for-loop")
        tt_opt = build_optimizers_with_moe_load_balancing([model], config, pd)
        groups = [g for o in tt_opt.optimizers for g in o.param_groups]
    out = []
    for step in range(1, a.steps + 1):
        rows = ids[(step - 1) * a.batch * (a.seq + 1) :][: a.batch * (a.seq + 1)]
        x_BS = rows.view(a.batch, a.seq + 1)
        with float_histc():
            logits_BSV = model(x_BS[:, :-1])
        F.cross_entropy(logits_BSV.flatten(0, 1).float(), x_BS[:, 1:].flatten()).backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        load_LE = torch.stack([b.moe.tokens_per_expert.clone() for b in model.layers.values()])
        out.append(sum(imbalance(load_E) for load_E in load_LE) / len(load_LE))
        for group in groups:
            group["lr"] = a.lr * min(1.0, step / a.warmup)
        if tt_opt is None:
            opt.step()
            if run[4] > 0:
                model.update_expert_bias(load_LE)
            model.reset_expert_load()
            opt.zero_grad()
        else:
            tt_opt.step()
            tt_opt.zero_grad()
    return out


def run_train(a: argparse.Namespace) -> None:
    tt = import_torchtitan(a.tt_site, Path(a.peer))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ids = peer_token_ids(Path(a.peer), a.steps * a.batch * (a.seq + 1))
    names = a.runs.split(",")
    print(f"train: {SMALL}, {a.layers} layers, 128 experts top-8, vocab {N_IDS}, batch "
          f"{a.batch} x seq {a.seq}, lr {a.lr} warm-up {a.warmup}, seed {a.seed}")  # fmt: skip
    results = {}
    for name in names:
        start = time.time()
        results[name] = train_loads(TRAIN_RUNS[name], a, ids, tt)
        print(f"  ({name}: {time.time() - start:.0f}s)", flush=True)
    print("step | " + " | ".join(names))
    for step in range(a.steps):
        print(f"{step + 1} | " + " | ".join(f"{results[n][step]:.2f}" for n in names))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["step0", "train"])
    ap.add_argument("--tt-site", required=True)
    ap.add_argument("--peer", default=str(PEER))
    ap.add_argument("--layers", type=int, default=None, help="step0: 2, train: 4")
    ap.add_argument("--seq", type=int, default=None, help="step0: 1024, train: 256")
    ap.add_argument("--batch", type=int, default=None, help="step0: 1, train: 2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--runs", default=",".join(TRAIN_RUNS), help="train: names of TRAIN_RUNS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    defaults = {"step0": (2, 1024, 1), "train": (4, 256, 2)}[a.mode]
    a.layers, a.seq, a.batch = (x if x is not None else d for x, d in zip(
        (a.layers, a.seq, a.batch), defaults))  # fmt: skip
    torch.set_num_threads(a.threads)
    (run_step0 if a.mode == "step0" else run_train)(a)


if __name__ == "__main__":
    main()
