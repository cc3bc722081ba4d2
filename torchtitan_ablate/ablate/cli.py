"""Run an ablation: one base recipe, named variants, one report.

    ttablate-ablate train_configs/ablations/zero2_vs_zero3_vs_hsdp.toml --ngpu 4 \\
        --set model.flavor=debugmodel --set training.seq_len=64 --set training.steps=5
    ttablate-ablate ABLATION.toml --dry-run      # validate + predict memory, no training
    ttablate-ablate ABLATION.toml --resume       # skip runs that finished before
    ttablate-ablate ABLATION.toml --overwrite    # delete the earlier runs in --out, run afresh
    ttablate-ablate ABLATION.toml --side-by-side 4   # 1-GPU runs 4 at a time on a 4-GPU node
    ttablate-ablate ABLATION.toml --resume --only a,b   # a study in parts: these variants now
    ttablate-ablate --report OUT                 # rebuild the report from finished runs
    ttablate-ablate --report OUT --estimate      # add predictions skipped by --no-estimate

(`python scripts/ablate.py ...` is the same command.) Runs launch the checkout's ./run_train.sh,
so planning and running need the package installed from a clone (pip install -e .); --report
works anywhere. The checkout is the one the command is launched from (scripts/ablate.py's own,
or the one holding the current directory), whichever clone the package was installed from
(checkout.py); outside any checkout, the installed one. Exit code 2 for a bad ablation file,
option, --set or variant, a --report folder without ablation.json, an --out folder that another
runner is using, or one that holds the runs of an earlier call without --resume or --overwrite
(one line naming it: a rerun never deletes earlier runs unasked); 130 / 143 when Ctrl-C /
SIGTERM stopped it (the runs in flight are stopped and recorded, the report covers the finished
ones); 0 otherwise: a failed run is recorded in the report and the others go on. See
docs/ablation.md.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

from torchtitan_ablate.ablate.ablation_file import AblationError, load_spec, parse_sets
from torchtitan_ablate.ablate.checkout import run_in_launching_checkout
from torchtitan_ablate.ablate.environment import ROOT
from torchtitan_ablate.components.checkpoint.dump_lock import acquire
from torchtitan_ablate.config import ConfigError

# The checkout this package lives in (an editable install); recipes and run_train.sh are there.
PROG = "ttablate-ablate"
RUNS = "runs"  # OUT/runs/<variant>/seed<N>, as plan.plan_variant names the run folders


def parse_args(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("ablation", nargs="?", help="ablation TOML (train_configs/ablations/*.toml)")
    p.add_argument("--out", help="output folder (default outputs/ablations/<name>)")
    p.add_argument("--dry-run", action="store_true", help="validate and predict memory only")
    p.add_argument("--resume", action="store_true", help="skip runs that finished before")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the runs an earlier call left in --out and start afresh "
                   "(without it or --resume, such a folder is refused)")  # fmt: skip
    p.add_argument("--ngpu", type=int, help="processes per run (default: the file's ngpu)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override for every variant (last word; repeatable)")  # fmt: skip
    p.add_argument("--report", metavar="DIR", help="only rebuild the report in DIR")
    p.add_argument("--no-estimate", action="store_true", help="skip the memory prediction")
    p.add_argument("--estimate", action="store_true",
                   help="with --report: predict the memory of variants planned with "
                   "--no-estimate (any machine; --set memory_estimation.device_memory_gib=N "
                   "for the fits verdict)")  # fmt: skip
    p.add_argument("--skip-invalid", action="store_true",
                   help="run the valid variants even if others fail validation")  # fmt: skip
    p.add_argument("--only", metavar="NAMES",
                   help="run only these variants (comma-separated); the others keep what an "
                   "earlier call left in --out (a study in parts: with --resume)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=0.0, help="seconds per run (0 = none)")
    p.add_argument("--side-by-side", type=int, default=1, metavar="N",
                   help="run up to N runs at a time, each on its own GPUs of this node "
                   "(default 1: one at a time)")  # fmt: skip
    args = p.parse_args(argv)
    if args.overwrite and args.resume:
        p.error("--overwrite deletes the earlier runs that --resume continues: give one")
    if args.estimate and not args.report:
        p.error("--estimate goes with --report DIR (a plan made with --no-estimate)")
    if not args.ablation and not args.report:
        p.error("give an ablation file, or --report DIR")
    if args.ngpu is not None and args.ngpu < 1:
        p.error(f"--ngpu {args.ngpu}: processes per run, at least 1")
    if args.side_by_side < 1:
        p.error(f"--side-by-side {args.side_by_side}: runs at a time, at least 1")
    if not args.timeout >= 0:  # also rejects nan
        p.error(f"--timeout {args.timeout:g}: seconds per run, 0 (no limit) or more")
    return args


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_plan(plan: dict) -> None:
    print(f"{plan['spec']['name']}: {plan['spec']['config_file']} on {plan['ngpu']} process(es)")
    print(f"{'variant':<22} {'gpus':>4} {'mesh':<22} {'gbs':>4} {'ga':>3} {'steps':>5}  "
          f"{'seeds':<10} predicted GiB  fits")  # fmt: skip
    for v in plan["variants"]:
        if v["error"]:
            print(f"{v['name']:<22} INVALID")
            continue
        lay, mem = v["layout"], v["memory"]
        fits = {True: "yes", False: "NO", None: "n/a"}[mem["fits"]]
        seeds = ",".join(str(s) for s in v["seeds"])
        print(
            f"{v['name']:<22} {lay['ngpu']:>4} {lay['mesh']:<22} {lay['global_batch_size']:>4} "
            f"{lay['grad_accum']:>3} {lay['steps']:>5}  {seeds:<10} "
            f"{_gib(mem['predicted_peak_gib']):>13}  {fits}"
        )
    notes = {v["memory"]["note"] for v in plan["variants"] if not v["error"]} - {""}
    for note in sorted(notes):
        print(f"predicted memory {note}")
    from torchtitan_ablate.ablate.plan import data_note

    if note := data_note(plan["variants"]):
        print(note)
    for v in plan["variants"]:
        if v["error"]:
            print(f"error: {v['error']}")


def _study_command(argv: list[str]) -> list[str]:
    """argv without --resume and --only: the report's command reproduces the whole study,
    however many calls it took."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--only":
            skip = True
        elif arg != "--resume" and not arg.startswith("--only="):
            out.append(arg)
    return out


def _only(names: str | None, plan: dict) -> set[str] | str | None:
    """--only's variant names, or the error line naming the unknown ones."""
    if names is None:
        return None
    chosen = {n.strip() for n in names.split(",") if n.strip()}
    known = [v["name"] for v in plan["variants"]]
    if chosen and chosen <= set(known):
        return chosen
    unknown = ", ".join(sorted(chosen - set(known))) or repr(names)
    return f"--only {names}: no variant {unknown}; the variants: {', '.join(known)}"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    if argv is None:  # a command, not a call: the code of the checkout it was launched from
        run_in_launching_checkout(sys.argv[1:], prog)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, prog)
    if args.ablation and not (ROOT / "run_train.sh").is_file():
        print(
            f"ablation error: {prog} launches ./run_train.sh of a repository checkout and this "
            f"install ({ROOT}) has none; install from a clone with pip install -e .",
            file=sys.stderr,
        )
        return 2
    # Paths as the user typed them, then work from the repository root: ablation files name
    # their base recipe relative to it, and run_train.sh runs there.
    ablation = args.ablation and os.path.relpath(Path(args.ablation).resolve(), ROOT)
    out_arg = args.out and Path(args.out).resolve()
    report_dir = args.report and Path(args.report).resolve()
    os.chdir(ROOT)
    from torchtitan_ablate.ablate.plan import make_plan, read_plan
    from torchtitan_ablate.ablate.report import write_report

    try:
        if report_dir:
            if args.estimate:
                from torchtitan_ablate.ablate.plan import fill_predictions

                plan = read_plan(report_dir)  # one line when the folder has no plan
                n = fill_predictions(report_dir, plan, parse_sets(args.set))
                print(f"predicted the memory of {n} variant(s)")
            rows = write_report(report_dir)
            print("\n".join(r["verdict"] for r in rows))
            print(f"report: {report_dir / 'report.md'}")
            return 0
        spec = load_spec(ablation)
        sets = parse_sets(args.set)
    except AblationError as e:
        print(f"ablation error: {e}", file=sys.stderr)
        return 2
    command = [*prog.split(), *_study_command(argv)]
    plan = make_plan(spec, ablation, args.ngpu, sets, command, not args.no_estimate)
    print_plan(plan)
    ngpus = {r["ngpu"] for v in plan["variants"] if not v["error"] for r in v["runs"]}
    if args.side_by_side > 1 and len(ngpus) > 1:
        print(
            f"note: the variants run on {sorted(ngpus)} GPUs; side by side a run shares the host "
            "with a varying number of others, so compare their tokens/s with care (a scaling "
            "study runs one at a time)"
        )
    only = _only(args.only, plan)
    if isinstance(only, str):
        print(f"ablation error: {only}", file=sys.stderr)
        return 2
    invalid = [v for v in plan["variants"] if v["error"] and (only is None or v["name"] in only)]
    if args.dry_run or (invalid and not args.skip_invalid):
        if invalid and not args.dry_run:
            print("not running: fix the variants above or pass --skip-invalid", file=sys.stderr)
        return 2 if invalid else 0
    out = out_arg or (ROOT / "outputs" / "ablations" / spec.name)
    plan["side_by_side"] = args.side_by_side
    out.mkdir(parents=True, exist_ok=True)
    try:  # one runner per study: it clears each run's folder before starting the run
        lock = acquire(str(out), "--out")
    except ConfigError as e:
        print(f"ablation error: {e}", file=sys.stderr)
        return 2
    try:
        earlier = _earlier_runs(out)
        if earlier and not (args.resume or args.overwrite):
            print(
                f"ablation error: --out {out} holds {len(earlier)} run folder(s) of an earlier "
                f"call ({', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}): --resume "
                "continues that study (finished runs are kept), another --out keeps both, "
                "--overwrite deletes them and starts afresh",
                file=sys.stderr,
            )
            return 2
        if earlier and args.overwrite:
            shutil.rmtree(out / RUNS)
            print(f"--overwrite: deleted the {len(earlier)} earlier run folder(s) in {out}")
        return _run_study(plan, out, args.resume, args.timeout, only)
    finally:
        lock.release()


def _earlier_runs(out: Path) -> list[str]:
    """The run folders (runs/<variant>/<seed>) that an earlier call left in out."""
    runs = out / RUNS
    if not runs.is_dir():
        return []
    return sorted(
        str(run.relative_to(out))
        for variant in runs.iterdir()
        if variant.is_dir()
        for run in variant.iterdir()
        if run.is_dir() and any(run.iterdir())
    )


def _run_study(plan: dict, out: Path, resume: bool, timeout: float, only: set[str] | None) -> int:
    """Writes the plan into out, runs it and writes the report; the exit code."""
    from torchtitan_ablate.ablate.plan import write_plan
    from torchtitan_ablate.ablate.report import write_report
    from torchtitan_ablate.ablate.runner import Stopped, run_all

    try:
        write_plan(plan, out, resume, only)
    except AblationError as e:  # --resume over a damaged plan: say so, never overwrite it
        print(f"ablation error: {e}; move it aside or rerun without --resume", file=sys.stderr)
        return 2
    try:
        run_all(plan, out, resume, timeout, only)
    except Stopped as e:
        write_report(out)
        print(
            f"ablation stopped ({e.why}): the runs in flight are recorded as stopped and the "
            f"report covers the finished ones ({out / 'report.md'}); rerun with --resume to finish",
            file=sys.stderr,
        )
        return 130 if e.why == "Ctrl-C" else 143
    rows = write_report(out)
    print("\n".join(r["verdict"] for r in rows))
    print(f"report: {out / 'report.md'}")
    return 0
