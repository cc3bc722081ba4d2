"""Qwen3 dense and MoE as the engine sees it: the family's entry in models/registry.py."""

from torchtitan_ablate.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_ablate.models.qwen3.generate import generate
from torchtitan_ablate.models.qwen3.model import Qwen3Model
from torchtitan_ablate.models.qwen3.parallelize import parallelize_qwen3, tp_split_sizes
from torchtitan_ablate.models.qwen3.sizes import build_model_args
from torchtitan_ablate.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan_ablate.models.spec import ModelSpec

QWEN3_SPEC = ModelSpec(
    name="qwen3",
    model_cls=Qwen3Model,
    args_cls=Qwen3ModelArgs,
    flavors=qwen3_flavors,
    build_args=build_model_args,
    parallelize=parallelize_qwen3,
    state_dict_adapter=Qwen3StateDictAdapter,
    hf_model_types=("qwen3", "qwen3_moe"),
    tp_split=tp_split_sizes,
    generate=generate,
)
