"""Keys that say one thing two ways (config/derived.py): training.steps or training.epochs,
lr_scheduler.warmup_steps or warmup_ratio. Both in one place is one error line; the command line
beats the recipe; the resolved config.toml records the derived value as a comment and loads
again."""

import pytest

from torchtitan_ablate.config import ConfigError, load_config, write_config
from torchtitan_ablate.config.derived import ceil_of, resolved_warmup_steps
from torchtitan_ablate.config.optim_config import LRScheduler

PAIRS = [
    ("training.steps", "10", "training.epochs", "1.5"),
    ("lr_scheduler.warmup_steps", "3", "lr_scheduler.warmup_ratio", "0.1"),
]


def _recipe(tmp_path, lines: dict[str, str]):
    sections: dict[str, list[str]] = {}
    for name, value in lines.items():
        section, key = name.split(".")
        sections.setdefault(section, []).append(f"{key} = {value}")
    text = "".join(f"[{s}]\n" + "\n".join(body) + "\n" for s, body in sections.items())
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return ["--job.config_file", str(path)]


@pytest.mark.parametrize("plain, plain_value, derived, derived_value", PAIRS)
def test_both_on_the_command_line_is_one_error_line(plain, plain_value, derived, derived_value):
    with pytest.raises(ConfigError) as e:
        load_config([f"--{plain}", plain_value, f"--{derived}", derived_value])
    msg = str(e.value)
    assert "\n" not in msg and "the command line sets both" in msg
    assert plain in msg and derived in msg


@pytest.mark.parametrize("plain, plain_value, derived, derived_value", PAIRS)
def test_both_in_the_recipe_is_one_error_line(tmp_path, plain, plain_value, derived, derived_value):
    with pytest.raises(ConfigError, match=f"the recipe sets both {plain} and {derived}"):
        load_config(_recipe(tmp_path, {plain: plain_value, derived: derived_value}))


def test_the_command_line_beats_the_recipe(tmp_path):
    # The recipe's steps, the command line's epochs: epochs (steps are derived at start-up).
    c = load_config(_recipe(tmp_path, {"training.steps": "10"}) + ["--training.epochs", "2"])
    assert c.training.epochs == 2.0
    # The recipe's epochs and warmup_ratio, the command line's steps and warmup_steps: those.
    recipe = _recipe(tmp_path, {"training.epochs": "2", "lr_scheduler.warmup_ratio": "0.5"})
    c = load_config(recipe + ["--training.steps", "7", "--lr_scheduler.warmup_steps", "2"])
    assert c.training.epochs is None and c.training.steps == 7
    assert c.lr_scheduler.warmup_ratio is None and c.lr_scheduler.warmup_steps == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--training.epochs", "0"], "training.epochs = 0.0: must be > 0"),
        (["--training.epochs", "-1"], "training.epochs = -1.0: must be > 0"),
        (["--training.epochs", "1", "--training.dataset", "synthetic"], "never ends"),
        (["--lr_scheduler.warmup_ratio", "1.5"], "lr_scheduler.warmup_ratio = 1.5"),
        (["--lr_scheduler.warmup_ratio", "-0.1"], "lr_scheduler.warmup_ratio = -0.1"),
    ],
)
def test_bad_values_are_one_line(args, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(args)


def test_exit_at_step_waits_for_the_derived_steps():
    """exit_at_step past the recipe's steps loads with epochs: the steps are not known yet
    (build.resolve_steps checks it against the derived count)."""
    c = load_config(
        ["--checkpoint.enable", "true", "--training.exit_at_step", "500"]
        + ["--training.epochs", "1"]
    )
    assert c.training.exit_at_step == 500


def test_warmup_ratio_rounds_up_the_decimal_written():
    """HF's ceil(ratio x steps), of the decimal: 0.07 x 100 is 7 (binary floats give 8)."""
    assert ceil_of(0.07, 100) == 7 and ceil_of(0.1, 3) == 1 and ceil_of(0.5, 0) == 0
    assert resolved_warmup_steps(LRScheduler(warmup_steps=9, warmup_ratio=0.25), 10) == 3
    assert resolved_warmup_steps(LRScheduler(warmup_steps=9), 10) == 9


def test_config_toml_comments_the_derived_values_and_loads_again(tmp_path):
    c = load_config(["--training.epochs", "1.5", "--lr_scheduler.warmup_ratio", "0.1"])
    c.training.steps = 40  # as build.resolve_steps leaves it
    path = tmp_path / "config.toml"
    write_config(c, str(path))
    text = path.read_text()
    assert "# steps = 40  (from training.epochs)\nepochs = 1.5" in text
    assert "# warmup_steps = 4  (from lr_scheduler.warmup_ratio)" in text
    again = load_config(["--job.config_file", str(path)])
    assert again.training.epochs == 1.5 and again.lr_scheduler.warmup_ratio == 0.1
