import json
import runpy

import pytest


def test_bench_with_hf_peer_writes_a_row_per_model(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    bench = runpy.run_path("scripts/bench.py")
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder"]
    args += [str(tmp_path), "--training.seq_len", "32", "--training.local_batch_size", "2"]
    rows = bench["main"](args + ["--steps", "1", "--warmup", "1", "--peer", "hf"])
    assert [r["name"] for r in rows] == ["torchtitan_ablate", "hf_Qwen3ForCausalLM"]
    assert rows[0]["tokens_per_step"] == rows[1]["tokens_per_step"] == 64
    assert all(r["tps"] > 0 for r in rows) and rows[1]["engine_speedup"] > 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert len(saved["rows"]) == 2
    assert "engine / hf_Qwen3ForCausalLM" in capsys.readouterr().out
