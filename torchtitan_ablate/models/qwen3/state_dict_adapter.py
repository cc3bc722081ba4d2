"""Native <-> Hugging Face state-dict conversion for Qwen3 and Qwen3-MoE.

HF names follow transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM. Routed experts come in two
layouts: "hub" (safetensors on the hub: mlp.experts.{e}.{gate,up,down}_proj.weight, 2-D each) and
"fused" (transformers 5.x: mlp.experts.gate_up_proj [E, 2I, D] with gate first, and
mlp.experts.down_proj [E, D, I]). from_hf accepts either; to_hf writes the one asked for.

Shape legend: E experts, I expert hidden dim, D model dim.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchtitan_ablate.models.common.state_dict import check_keys
from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs
from torchtitan_ablate.models.qwen3.hf_experts import HUB_EXPERT, expert_reader
from torchtitan_ablate.models.spec import ReadHF, Region

# native suffix within a block -> HF suffix within model.layers.N.
BLOCK_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_KEYS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# Native -> HF names of the block entries that map one to one.
ONE_TO_ONE = {**BLOCK_KEYS, **DENSE_KEYS, "moe.router.gate.weight": "mlp.gate.weight"}
LAYOUTS = ("hub", "fused")


class Qwen3StateDictAdapter:
    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        self.args = model_args

    # ---- expected names and shapes ---------------------------------------------------------------

    def native_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every persistent entry of Qwen3Model(args).state_dict() with its shape."""
        a = self.args
        shapes = {"tok_embeddings.weight": (a.vocab_size, a.dim), "norm.weight": (a.dim,)}
        shapes["output.weight"] = (a.vocab_size, a.dim)
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        block = {
            "attention.wq.weight": (q_dim, a.dim),
            "attention.wk.weight": (kv_dim, a.dim),
            "attention.wv.weight": (kv_dim, a.dim),
            "attention.wo.weight": (a.dim, q_dim),
            "attention.q_norm.weight": (a.head_dim,),
            "attention.k_norm.weight": (a.head_dim,),
            "attention_norm.weight": (a.dim,),
            "ffn_norm.weight": (a.dim,),
        }
        dense = {
            "feed_forward.w1.weight": (a.hidden_dim, a.dim),
            "feed_forward.w3.weight": (a.hidden_dim, a.dim),
            "feed_forward.w2.weight": (a.dim, a.hidden_dim),
        }
        e, i = a.num_experts, a.moe_hidden_dim
        moe = {
            "moe.router.gate.weight": (e, a.dim),
            "moe.experts.w1": (e, i, a.dim),
            "moe.experts.w3": (e, i, a.dim),
            "moe.experts.w2": (e, a.dim, i),
        }
        if a.moe_bias_update_rate > 0:
            moe["moe.expert_bias"] = (e,)
        for n in range(a.n_layers):
            mlp = moe if a.is_moe_layer(n) else dense
            shapes.update({f"layers.{n}.{k}": s for k, s in {**block, **mlp}.items()})
        return shapes

    def hf_shapes(self, layout: str = "hub") -> dict[str, tuple[int, ...]]:
        """Every key an HF state dict of this model holds in `layout` (lm_head only if untied)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
        a = self.args
        shapes = {"model.embed_tokens.weight": (a.vocab_size, a.dim), "model.norm.weight": (a.dim,)}
        if not a.tie_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, a.dim)
        native = self.native_shapes()
        e, i = a.num_experts, a.moe_hidden_dim
        for _, theirs, plain, moe in _blocks(a):
            shapes.update({hf_key: native[key] for key, hf_key in plain.items()})
            if not moe:
                continue
            shapes[theirs + "mlp.gate.weight"] = (e, a.dim)
            if layout == "fused":
                shapes[theirs + "mlp.experts.gate_up_proj"] = (e, 2 * i, a.dim)
                shapes[theirs + "mlp.experts.down_proj"] = (e, a.dim, i)
                continue
            for x in range(e):
                for w, name in HUB_EXPERT.items():
                    shape = (a.dim, i) if w == "w2" else (i, a.dim)
                    shapes[f"{theirs}mlp.experts.{x}.{name}.weight"] = shape
        return shapes

    def hf_layout(self, hf_keys: Iterable[str]) -> str:
        """ "fused" when the experts come as gate_up_proj / down_proj stacks, else "hub"."""
        return "fused" if any(k.endswith("mlp.experts.down_proj") for k in hf_keys) else "hub"

    def hf_accepted(self, layout: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """hf_shapes, plus the lm_head that a tied checkpoint may still carry (never read)."""
        expected, optional = self.hf_shapes(layout), set()
        if self.args.tie_embeddings:
            expected["lm_head.weight"] = (self.args.vocab_size, self.args.dim)
            optional.add("lm_head.weight")
        return expected, optional

    def tied_keys(self) -> dict[str, str]:
        return {"output.weight": "tok_embeddings.weight"} if self.args.tie_embeddings else {}

    def no_hf_counterpart(self, key: str) -> bool:
        """The expert bias of aux-loss-free balancing (HF's Qwen3-MoE has none)."""
        return key.endswith("moe.expert_bias")

    def hf_key(self, key: str) -> str:
        """HF name of every native entry but the routed experts' stacks (KeyError for those)."""
        top = {
            "tok_embeddings.weight": "model.embed_tokens.weight",
            "norm.weight": "model.norm.weight",
            "output.weight": (
                "model.embed_tokens.weight" if self.args.tie_embeddings else "lm_head.weight"
            ),
        }
        if key in top:
            return top[key]
        _, n, suffix = key.split(".", 2)
        return f"model.layers.{n}.{ONE_TO_ONE[suffix]}"

    def hf_reader(self, key: str, layout: str, read: ReadHF) -> Callable[[Region], torch.Tensor]:
        if ".moe.experts." in key:  # layers.N.moe.experts.w1: read per expert or sliced
            _, n, _, _, w = key.split(".")
            return expert_reader(f"model.layers.{n}.", w, self.args, layout, read)
        hf_key = self.hf_key(key)
        return lambda region: read(hf_key, region)

    def hf_config(self, source: dict[str, Any] | None = None) -> dict[str, Any]:
        """`source` with our keys on top (Qwen3ForCausalLM or Qwen3MoeForCausalLM)."""
        config = dict(source or {})
        config.pop("num_local_experts", None)  # ours says num_experts (the hub spelling)
        config.update(self.args.to_hf_config())
        return config

    # ---- conversion ----------------------------------------------------------------------------

    def to_hf(
        self, native_sd: dict[str, torch.Tensor], layout: str = "hub"
    ) -> dict[str, torch.Tensor]:
        """Native -> HF. Tied models omit lm_head; expert_bias (no HF equivalent) is dropped."""
        optional = {"output.weight"} if self.args.tie_embeddings else set()
        optional |= {k for k in native_sd if k.endswith("moe.expert_bias")}
        check_keys(native_sd, self.native_shapes(), optional, "native")
        a = self.args
        hf = {
            "model.embed_tokens.weight": native_sd["tok_embeddings.weight"],
            "model.norm.weight": native_sd["norm.weight"],
        }
        if not a.tie_embeddings:
            hf["lm_head.weight"] = native_sd["output.weight"]
        for ours, theirs, plain, moe in _blocks(a):
            hf.update({hf_key: native_sd[key] for key, hf_key in plain.items()})
            if not moe:
                continue
            hf[theirs + "mlp.gate.weight"] = native_sd[ours + "moe.router.gate.weight"]
            w = {k: native_sd[f"{ours}moe.experts.{k}"] for k in HUB_EXPERT}
            if layout == "fused":
                hf[theirs + "mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
                hf[theirs + "mlp.experts.down_proj"] = w["w2"]
                continue
            for x in range(a.num_experts):
                for k, name in HUB_EXPERT.items():
                    hf[f"{theirs}mlp.experts.{x}.{name}.weight"] = w[k][x]
        check_keys(hf, self.hf_shapes(layout), set(), f"HF ({layout})")
        return hf

    def from_hf(self, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF (hub or fused expert layout) -> native, ready for load_state_dict(strict=True)."""
        layout = self.hf_layout(hf_sd)
        a = self.args
        expected, optional = self.hf_accepted(layout)
        check_keys(hf_sd, expected, optional, f"HF ({layout})")
        embed = hf_sd["model.embed_tokens.weight"]
        native = {"tok_embeddings.weight": embed, "norm.weight": hf_sd["model.norm.weight"]}
        native["output.weight"] = embed if a.tie_embeddings else hf_sd["lm_head.weight"]
        for ours, theirs, plain, moe in _blocks(a):
            native.update({key: hf_sd[hf_key] for key, hf_key in plain.items()})
            if not moe:
                continue
            native[ours + "moe.router.gate.weight"] = hf_sd[theirs + "mlp.gate.weight"]
            if layout == "fused":
                gate_up_E2ID = hf_sd[theirs + "mlp.experts.gate_up_proj"]
                w1_EID, w3_EID = gate_up_E2ID.chunk(2, dim=1)
                w = {"w1": w1_EID, "w3": w3_EID, "w2": hf_sd[theirs + "mlp.experts.down_proj"]}
            else:
                w = {
                    k: torch.stack(
                        [
                            hf_sd[f"{theirs}mlp.experts.{x}.{name}.weight"]
                            for x in range(a.num_experts)
                        ]
                    )
                    for k, name in HUB_EXPERT.items()
                }
            native.update({f"{ours}moe.experts.{k}": t for k, t in w.items()})
            if a.moe_bias_update_rate > 0:
                native[ours + "moe.expert_bias"] = torch.zeros(a.num_experts)
        return native


def _blocks(args: Qwen3ModelArgs) -> Iterator[tuple[str, str, dict[str, str], bool]]:
    """Per block: its native prefix, its HF prefix, native -> HF name of each key that maps one to
    one (attention, norms, dense MLP), and whether its MLP is MoE."""
    for n in range(args.n_layers):
        ours, theirs, moe = f"layers.{n}.", f"model.layers.{n}.", args.is_moe_layer(n)
        suffixes = {**BLOCK_KEYS, **({} if moe else DENSE_KEYS)}
        yield ours, theirs, {ours + k: theirs + v for k, v in suffixes.items()}, moe
