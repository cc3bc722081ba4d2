"""Ablation runner: one base recipe, named override sets, a decision-ready report.

    python scripts/ablate.py ABLATION.toml [--out DIR] [--dry-run] [--resume] [--ngpu N]
                             [--set section.key=value ...]
    python scripts/ablate.py --report DIR

ablation_file.py reads the ablation file, plan.py validates it, runner.py runs it, and report.py,
markdown.py and plots.py write results.csv, results.json, report.md and the plots. See
docs/ablation.md.
"""

from torchtitan_ablate.ablate.ablation_file import AblationError, AblationSpec, Variant, load_spec

__all__ = ["AblationError", "AblationSpec", "Variant", "load_spec"]
