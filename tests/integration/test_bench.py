import importlib.util
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


@pytest.mark.parametrize(
    "option, message", [(["--steps", "0"], "--steps 0"), (["--warmup", "-1"], "--warmup -1")]
)
def test_bad_step_counts_exit_2(option, message, capsys):
    bench = runpy.run_path("scripts/bench.py")
    with pytest.raises(SystemExit) as e:
        bench["main"](option)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_hf_peer_without_transformers_fails_before_benchmarking(monkeypatch, capsys):
    bench = runpy.run_path("scripts/bench.py")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else find_spec(name, *a),
    )
    # No config arguments: the check comes before the config is even read.
    with pytest.raises(SystemExit) as e:
        bench["main"](["--peer", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [
        "bench: --peer hf needs transformers: pip install transformers"
    ]


def test_profile_trace_writes_the_profiled_steps_gzipped(tmp_path):
    import gzip

    bench = runpy.run_path("scripts/bench.py")
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder"]
    args += [str(tmp_path), "--training.seq_len", "32", "--training.local_batch_size", "2"]
    trace = tmp_path / "t.json.gz"
    bench["main"](args + ["--steps", "1", "--warmup", "0", "--profile", "--trace", str(trace)])
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


def test_trace_without_profile_exits_2(capsys):
    bench = runpy.run_path("scripts/bench.py")
    with pytest.raises(SystemExit) as e:
        bench["main"](["--trace", "t.json"])
    assert e.value.code == 2 and "add --profile" in capsys.readouterr().err


def test_bench_corpus_switch_trains_on_it_and_records_its_hash(tmp_path, capsys):
    from torchtitan_ablate.components.text.bench_corpus import build

    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"m{i}.py").write_text(f'"""Module {i} parses values."""\nx = {i}\n')
    manifest = build(tmp_path / "corpus", tmp_path / "src", vocab_size=300)
    bench = runpy.run_path("scripts/bench.py")
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder"]
    args += [str(tmp_path), "--training.seq_len", "32", "--training.local_batch_size", "2"]
    bench["main"](
        args + ["--steps", "1", "--warmup", "0", "--bench-corpus", str(tmp_path / "corpus")]
    )
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["corpus"]["content_hash"] == manifest["content_hash"]
    assert f"data: {saved['corpus']}" in capsys.readouterr().out
