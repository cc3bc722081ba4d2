"""HF checkpoints: tiny random transformers models load into ours with equal logits (single file,
sharded with an index, hub and fused expert layouts), export back, and bad folders fail clearly."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
)

from tests.helpers.hf_model import make_hf
from torchtitan_ablate.components.checkpoint.hf import (
    INDEX_FILE,
    hf_model_args,
    load_hf_weights,
    save_hf_checkpoint,
)
from torchtitan_ablate.config import ConfigError
from torchtitan_ablate.models.qwen3 import Qwen3Model
from torchtitan_ablate.models.qwen3.args import qwen3_flavors


def hf_logits(model: torch.nn.Module, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return tokens, model(tokens).logits


def ours_from(path: Path) -> Qwen3Model:
    model = Qwen3Model(hf_model_args(path))
    sd = model.state_dict()
    load_hf_weights(sd, path)
    model.load_state_dict(sd)
    return model.eval()


@pytest.mark.parametrize("kind", ["dense", "dense_tied", "moe"])
def test_load_export_reload_equal_logits(tmp_path, kind):
    hf = make_hf(kind, tmp_path / "hf")
    tokens, expected = hf_logits(hf, 96)
    ours = ours_from(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=1e-5)
    # export sharded (tiny shard limit), transformers reads it back
    files = save_hf_checkpoint(
        ours.state_dict(), ours.args, tmp_path / "out", max_shard_bytes=20_000
    )
    assert INDEX_FILE in files and "config.json" in files
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    # and ours reads the sharded export too
    with torch.no_grad():
        torch.testing.assert_close(
            ours_from(tmp_path / "out")(tokens), expected, atol=1e-5, rtol=1e-5
        )


def test_fused_expert_layout_loads(tmp_path):
    hf = make_hf("moe", tmp_path / "hub")
    tokens, expected = hf_logits(hf, 96)
    fused = tmp_path / "fused"
    fused.mkdir()
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}  # transformers 5: fused
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    save_file(sd, fused / "model.safetensors")
    (fused / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(ours_from(fused)(tokens), expected, atol=1e-5, rtol=1e-5)


def test_missing_keys_and_shape_mismatches_are_listed(tmp_path):
    hf = make_hf("dense", tmp_path / "hf")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.norm.weight"] = torch.ones(63)
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path = ") as err:
        ours_from(tmp_path / "hf")
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.norm.weight: got (63,), expected (64,)" in str(err.value)


def test_model_not_matching_config_is_an_error(tmp_path):
    make_hf("dense", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    model = Qwen3Model(hf_model_args(tmp_path / "hf", hidden_dim=96))
    with pytest.raises(ConfigError, match="feed_forward.w1.weight.*model.flavor = 'auto'"):
        load_hf_weights(model.state_dict(), tmp_path / "hf")
    assert config["intermediate_size"] == 80


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "no such folder"),
        ("empty", "holds no config.json"),
        ("bad_config", "config.json is not valid JSON"),
        ("no_weights", "holds neither model.safetensors nor"),
        ("garbage_weights", "cannot read its \\*.safetensors"),
    ],
)
def test_bad_folder_is_a_config_error(tmp_path, case, match):
    path = tmp_path / "hf"
    if case != "missing":
        path.mkdir()
    if case == "bad_config":
        (path / "config.json").write_text("{oops")
    if case in ("no_weights", "garbage_weights"):
        config = qwen3_flavors["debugmodel"].to_hf_config()
        (path / "config.json").write_text(json.dumps(config))
    if case == "garbage_weights":
        (path / "model.safetensors").write_text("garbage")
    with pytest.raises(ConfigError, match=match) as err:
        load_hf_weights({}, path)
    assert str(err.value).startswith(f"checkpoint.initial_load_path = {str(path)!r} ")
    assert "\n" not in str(err.value)
