"""The ablation file format: parsing, flattening, precedence of overrides, clear errors."""

import pytest

from torchtitan_ablate.ablate.ablation_file import AblationError, cli_arg, load_spec, parse_sets

GOOD = """
[ablation]
config_file = "train_configs/debug_model.toml"
ngpu = 2
seeds = [1, 2]
steps = 4

[overrides]
training.seq_len = 64
"metrics.log_freq" = 1

[variants.zero3]
parallelism.fsdp_reshard_after_forward = "always"

[variants.zero2]
group = "z2"
[variants.zero2.parallelism]
fsdp_reshard_after_forward = "never"
"""


def write(tmp_path, text: str):
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


def test_parse_and_run_args(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.name == "study" and spec.ngpu == 2 and spec.seeds == [1, 2]
    assert [v.name for v in spec.variants] == ["zero3", "zero2"]  # file order: baseline first
    assert spec.variants[1].group == "z2"
    assert spec.overrides == {"training.seq_len": 64, "metrics.log_freq": 1}
    args = spec.run_args(spec.variants[1], 2, ["training.seq_len=32"])
    assert args == [
        "--training.throughput_warmup_steps=1",  # runner-owned, first
        "--metrics.comm_profile=true",  # profile = true by default: overrides may turn it off
        "--training.steps=4",
        "--training.seq_len=64",
        "--metrics.log_freq=1",
        "--parallelism.fsdp_reshard_after_forward=never",
        "--training.seed=2",
        "--training.seq_len=32",  # --set comes last: it wins
    ]


def test_cli_arg_values():
    assert cli_arg("compile.enable", True) == "--compile.enable=true"
    assert cli_arg("compile.components", ["model", "loss"]) == "--compile.components=model,loss"
    assert cli_arg("optimizer.lr", 3e-4) == "--optimizer.lr=0.0003"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[ablation]\nconfig_file='x'\n", "no [variants.NAME]"),
        ("[variants.a]\ntraining.steps = 1\n", "needs config_file"),
        ("[ablation]\nconfig_file='x'\nseedz=[1]\n[variants.a]\n", "unknown [ablation] key"),
        ("[ablation]\nconfig_file='x'\n[variants.a]\nsteps = 1\n", "'steps' is not a section.key"),
        ("[ablation]\nconfig_file='x'\n[variants.a]\njob.dump_folder='o'\n", "set by the ablation"),
        ("[ablation]\nconfig_file='x'\nseeds=[]\n[variants.a]\n", "seeds = []"),
        ("[ablation]\nconfig_file='x'\n[variantz.a]\n", "unknown table"),
        ("[ablation\n", "cannot read"),
        ("ablation = 3\n", "ablation = 3: must be a table"),
        ("overrides = 3\n[ablation]\nconfig_file='x'\n[variants.a]\n", "overrides = 3"),
        ("variants = 3\n[ablation]\nconfig_file='x'\n", "variants = 3"),
        ("[ablation]\nconfig_file=5\n[variants.a]\n", "config_file = 5: a path"),
        ("[ablation]\nconfig_file='x'\nname=5\n[variants.a]\n", "name = 5: a string"),
        ("[ablation]\nconfig_file='x'\nname='../x'\n[variants.a]\n", "names become folders"),
        ("[ablation]\nconfig_file='x'\nngpu=0\n[variants.a]\n", "ngpu = 0: a positive"),
        ("[ablation]\nconfig_file='x'\nseeds=[1, 1]\n[variants.a]\n", "each seed once"),
        ("[ablation]\nconfig_file='x'\n[variants.'../../escape']\n", "names become folders"),
        ("[ablation]\nconfig_file='x'\n[variants.'..']\n", "names become folders"),
        ("[ablation]\nconfig_file='x'\n[variants.a]\ngroup=3\n", "group = 3: a string"),
        ("[ablation]\nconfig_file='x'\n[variants.a]\nbaseline='zz'\n", "baseline = 'zz': name a"),
        (
            "[ablation]\nconfig_file='x'\n[overrides]\n'training.steps'=3\ntraining.steps=4\n"
            "[variants.a]\n",
            "training.steps is given twice",
        ),
    ],
)
def test_bad_files_name_the_problem(tmp_path, text, message):
    with pytest.raises(AblationError, match=message.replace("[", r"\[")):
        load_spec(write(tmp_path, text))


def test_bad_set():
    assert parse_sets(["training.steps=3"]) == ["training.steps=3"]
    for bad in ["training.steps", "steps=3", "job.dump_folder=x"]:
        with pytest.raises(AblationError):
            parse_sets([bad])


def test_a_variants_data_mixture_reaches_the_trainer_as_a_list(tmp_path):
    from torchtitan_ablate.config import load_config

    spec = load_spec(
        write(
            tmp_path,
            GOOD
            + '[variants.mix]\ntraining.dataset_path = ["a.jsonl", "odd,name.jsonl"]\n'
            + "training.dataset_weights = [0.7, 0.3]\n"
            + '[variants.one]\ntraining.dataset_path = "odd,name.jsonl"\n',
        )
    )
    mix, one = spec.variants[2:]
    t = load_config(spec.run_args(mix, None, [])).training
    assert t.dataset_path == ["a.jsonl", "odd,name.jsonl"] and t.dataset_weights == [0.7, 0.3]
    assert load_config(spec.run_args(one, None, [])).training.dataset_path == "odd,name.jsonl"
