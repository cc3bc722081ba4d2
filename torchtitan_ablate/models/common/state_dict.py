"""The name-and-shape check every state-dict conversion makes before it moves any tensor."""

import torch


def check_keys(
    sd: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    optional: set[str],
    what: str,
) -> None:
    """ValueError naming every missing/unexpected key and shape mismatch (first 20 of each)."""
    missing = sorted(set(expected) - set(sd) - optional)
    unexpected = sorted(set(sd) - set(expected))
    mismatched = sorted(
        f"{k}: got {tuple(sd[k].shape)}, expected {expected[k]}"
        for k in set(sd) & set(expected)
        if tuple(sd[k].shape) != tuple(expected[k])
    )
    problems = []
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches", mismatched),
    ):
        if items:
            more = f" (+{len(items) - 20} more)" if len(items) > 20 else ""
            problems.append(f"{label}: {items[:20]}{more}")
    if problems:
        raise ValueError(f"{what} state dict does not match the model args: " + "; ".join(problems))
