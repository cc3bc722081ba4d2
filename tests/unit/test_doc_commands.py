"""Every command in the code blocks of README.md and docs/*.md works as written, short of running
it (the laptop path, tests/integration/test_laptop_path.py, is run):

- training and estimation commands (run_train.sh with its CONFIG_FILE / NGPU / NNODES prefix,
  python -m torchtitan_ablate.train, ttablate-*, estimation.py, scripts/bench.py under torchrun,
  scripts/validate_estimator.py's --configs, every variant of an ablation file) pass the
  launcher's precheck, and their parallel layout fits the world size they name;
- scripts/*.py exist and know every option given (their --help, or ablate's own parser);
  shell scripts exist;
- a checkpoint or export under outputs/ that a command reads is what another documented command
  writes (a run's checkpoint/step-K at a step it saves, or convert_checkpoint.py's OUT_DIR;
  `step-N` stands for any step of that run).
Placeholders (X, HF_DIR, <...>, ~/..., /path/to/...) stand for the user's files: a placeholder
recipe is checked as the launcher's default recipe, and no layout is checked against a
placeholder's sizes."""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.helpers.doc_commands import (
    ROOT,
    Command,
    all_commands,
    is_placeholder,
    markdown_commands,
)
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.config.precheck import check_before_torch

COMMANDS = all_commands()
ABLATION = "train_configs/ablations/zero2_vs_zero3_vs_hsdp.toml"
MOE = "train_configs/qwen3_moe_debug.toml"
DEFAULT_RECIPE = "train_configs/debug_model.toml"  # run_train.sh's CONFIG_FILE default
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# An option line of argparse's help that names a value: `  --flag VALUE`, `--peer {hf}`.
TAKES_VALUE = re.compile(r"^\s+(?:-\w, )?(--[\w-]+)[ =][A-Z{\[]", re.M)


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands' relative paths are from the repository's root


def _recipe(word: str) -> str:
    if word.startswith("/path/to/") and (ROOT / word[len("/path/to/") :]).exists():
        return word[len("/path/to/") :]
    return DEFAULT_RECIPE if is_placeholder(word) else word


def trainer_argv(args: list[str], config_file: str | None) -> list[str]:
    """The trainer's arguments as the launcher passes them, placeholder recipes replaced."""
    argv = (["--job.config_file", config_file] if config_file else []) + args
    return [_recipe(w) if p == "--job.config_file" else w for p, w in zip(["", *argv], argv)]


def precheck(argv: list[str], prog: str = "./run_train.sh") -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            check_before_torch(argv, prog)
        except SystemExit as e:
            pytest.fail(f"{shlex.join(argv)}: exit {e.code}: {err.getvalue().strip()}")


def check_trainer(argv: list[str], world_size: int) -> None:
    """Precheck, then (no placeholder in it) the layout against the world size."""
    from torchtitan_ablate.build import check_layout  # imports torch

    precheck(argv)
    if world_size > 0 and not any(is_placeholder(w) for w in argv):
        config = load_config(argv)
        if not config.memory_estimation.enable:
            try:
                check_layout(config, world_size)
            except ConfigError as e:
                pytest.fail(f"{shlex.join(argv)} at world size {world_size}: {e}")


def config_args(args: list[str]) -> list[str]:
    """The `--section.key [value]` words of a command whose own options are not dotted."""
    out = []
    for i, word in enumerate(args):
        if word.startswith("--") and "." in word.split("=")[0]:
            out.append(word)
            following = args[i + 1] if i + 1 < len(args) else "--"
            if "=" not in word and not following.startswith("--"):
                out.append(following)
    return out


@cache
def script_help(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{script} --help: {done.stderr}"
    return done.stdout


def positionals(script: str, args: list[str]) -> list[str]:
    """The words of `args` that are neither options nor an option's value."""
    valued = set(TAKES_VALUE.findall(script_help(script)))
    out, skip = [], False
    for word in args:
        if skip or word.startswith("-"):
            skip = not skip and word in valued
            continue
        out.append(word)
    return out


def check_ablate(args: list[str]) -> None:
    from torchtitan_ablate.ablate.ablation_file import load_spec, parse_sets
    from torchtitan_ablate.ablate.cli import parse_args

    try:
        a = parse_args(args, "scripts/ablate.py")
    except SystemExit as e:
        pytest.fail(f"scripts/ablate.py {shlex.join(args)}: exit {e.code}")
    if a.ablation and not is_placeholder(a.ablation):
        spec = load_spec(a.ablation)
        for variant in spec.variants:
            run = spec.run_args(variant, None, parse_sets(a.set))
            ngpu = variant.ngpu or a.ngpu or spec.ngpu
            check_trainer(["--job.config_file", spec.config_file, *run], ngpu)


def check_script(script: str, args: list[str], world_size: int = 1) -> None:
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script == "scripts/ablate.py":
        return check_ablate(args)
    known = set(OPTION.findall(script_help(script)))
    own = [w.split("=")[0] for w in args if w.startswith("--") and w not in config_args(args)]
    assert set(own) <= known, f"{script} has no option {sorted(set(own) - known)}"
    if script == "scripts/bench.py":
        check_trainer(config_args(args), world_size)
    if script == "scripts/validate_estimator.py":
        world = int(args[args.index("--world_size") + 1]) if "--world_size" in args else 1
        for spec in args[args.index("--configs") + 1 :]:
            recipe, *rest = shlex.split(spec)
            check_trainer(["--job.config_file", recipe, *rest], world)


def check_torchrun(words: list[str]) -> None:
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    options = " ".join(words[1:script]).replace("=", " ").split()
    world = int(options[options.index("--nproc_per_node") + 1])
    check_script(words[script], words[script + 1 :], world)


def check(c: Command) -> None:
    w, env = c.words, c.env
    world = int(env.get("NGPU", 1)) * int(env.get("NNODES", 1))
    if w[0] in ("./run_train.sh", "run_train.sh"):
        check_trainer(trainer_argv(w[1:], env.get("CONFIG_FILE", DEFAULT_RECIPE)), world)
    elif w[0] == "ttablate-train" or w[:3] == ["python", "-m", "torchtitan_ablate.train"]:
        check_trainer(trainer_argv(w[1 if w[0] == "ttablate-train" else 3 :], None), world)
    elif w[0] in ("python", "python3") and w[1] == "-":
        compile(c.stdin or "", c.id, "exec")  # a here-document: Python that parses
    elif w[0] in ("python", "python3") and w[1] == "estimation.py":
        precheck(trainer_argv(w[2:], None), "python estimation.py")
    elif w[0] in ("python", "python3"):
        check_script(w[1], w[2:])
    elif w[0] == "torchrun":
        check_torchrun(w)
    elif w[0] in ("bash", "sbatch"):
        assert (ROOT / w[1]).is_file(), f"{w[1]} does not exist"
    elif w[0].removeprefix("./").startswith("scripts/"):
        path = ROOT / w[0]
        assert path.is_file() and os.access(path, os.X_OK), f"{w[0]} is not an executable script"
    else:
        pytest.fail(f"{c.id}: unknown program {w[0]!r}: teach tests/unit/test_doc_commands.py it")


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command_is_valid(command):
    check(command)


def _trainer_argv(c: Command) -> list[str] | None:
    w = c.words
    if w[0] in ("./run_train.sh", "run_train.sh"):
        return trainer_argv(w[1:], c.env.get("CONFIG_FILE", DEFAULT_RECIPE))
    if w[0] == "ttablate-train" or w[:3] == ["python", "-m", "torchtitan_ablate.train"]:
        return trainer_argv(w[1 if w[0] == "ttablate-train" else 3 :], None)
    return None


def _script(c: Command) -> str | None:
    return c.words[1] if c.words[0] in ("python", "python3") else None


def written(c: Command) -> set[str]:
    """The checkpoint folders a documented command writes (convert_checkpoint.py: its OUT_DIR)."""
    if _script(c) == "scripts/convert_checkpoint.py":
        return {os.path.normpath(positionals(_script(c), c.words[2:])[1])}
    argv = _trainer_argv(c)
    if argv is None:
        return set()
    config = load_config(argv)
    ck, steps = config.checkpoint, config.training.steps
    if not ck.enable or config.memory_estimation.enable:
        return set()
    folder = Path(os.path.relpath(config.job.dump_folder, ROOT)) / ck.folder
    saved = {0} if ck.create_seed_checkpoint else {*range(ck.interval, steps, ck.interval), steps}
    hf = {f"{folder}/step-{steps}/hf"} if ck.last_save_in_hf else set()
    return {f"{folder}/step-{k}" for k in saved} | hf


def read(c: Command) -> list[str]:
    """The paths under outputs/ that a command loads: a checkpoint or export."""
    found = []
    if _trainer_argv(c) is not None:
        argv = c.words
        found = [v for k, v in zip(argv, argv[1:]) if k == "--checkpoint.initial_load_path"]
    elif _script(c) in ("scripts/generate.py", "scripts/convert_checkpoint.py"):
        found = positionals(_script(c), c.words[2:])[:1]
    return [os.path.normpath(p) for p in found if p.startswith(("outputs/", "./outputs/"))]


def test_read_checkpoints_are_written_by_a_documented_command():
    made = set().union(*(written(c) for c in COMMANDS))
    missing = []
    for c in COMMANDS:
        for path in read(c):
            any_step = re.fullmatch(r"(.*/step-)[A-Z]", path)
            if path not in made and not (any_step and any(m.startswith(any_step[1]) for m in made)):
                missing.append(f"{c.id}: {path}")
    assert missing == [], "no documented command writes these:\n" + "\n".join(missing)
    assert {"outputs/laptop/pretrain/checkpoint/step-20", "outputs/laptop/hf"} <= made


def test_the_checks_catch_what_they_are_for():
    wrong = {
        "./run_train.sh --training.stepz 5": "unknown key 'training.stepz'",
        "NGPU=3 ./run_train.sh --parallelism.data_parallel_replicate_degree 2": "not divisible",
        "python scripts/generate.py outputs/x/checkpoint/step-5 --top-k 1": "no option",
        f"python scripts/ablate.py {ABLATION} --set a.b=1": "unknown config section",
        f"torchrun --nproc_per_node 3 scripts/bench.py --job.config_file {MOE} "
        "--parallelism.expert_parallel_degree 2": "must divide",
        "make all": "unknown program",
    }
    for line, why in wrong.items():
        (c,) = markdown_commands(f"```bash\n{line}\n```", "page")
        with pytest.raises((AssertionError, pytest.fail.Exception), match=why):
            check(c)
    (old,) = markdown_commands(
        "```\npython scripts/generate.py outputs/debug_model/ck/step-50\n```", ""
    )
    assert read(old) == ["outputs/debug_model/ck/step-50"]
    (debug_run,) = markdown_commands(
        "```bash\n./run_train.sh --checkpoint.enable --checkpoint.interval 20\n```", ""
    )
    assert written(debug_run) == {f"outputs/debug_model/checkpoint/step-{k}" for k in (20, 40, 50)}
