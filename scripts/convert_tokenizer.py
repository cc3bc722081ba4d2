"""Convert a Hugging Face byte-level BPE tokenizer.json to a tiktoken ranks file.

Usage: python scripts/convert_tokenizer.py path/to/tokenizer.json out.tiktoken

The ranks file holds the regular tokens only; build_tokenizer() appends <|endoftext|>,
<|im_start|>, <|im_end|> right after the last rank, which are Qwen's ids when converting Qwen's
tokenizer.json (151643..151645). Other added tokens are listed but not written; load the
tokenizer.json itself to keep all of them. The ranks file is read with Qwen's pre-tokenizer regex,
so converting a tokenizer with another regex prints a warning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without installing

from torchtitan_ablate.components.tokenizer import (  # noqa: E402
    QWEN_PATTERN,
    TIKTOKEN_SPECIALS,
    hf_tokenizer_json_to_ranks,
    save_tiktoken_ranks,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_json", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    try:
        data = json.loads(args.tokenizer_json.read_text(encoding="utf-8"))
        ranks, specials, pattern = hf_tokenizer_json_to_ranks(data)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"cannot convert {args.tokenizer_json}: {e}")
    save_tiktoken_ranks(ranks, args.output)
    print(f"wrote {args.output}: {len(ranks)} ranks (0..{max(ranks.values())})")
    first = max(ranks.values()) + 1
    for i, name in enumerate(TIKTOKEN_SPECIALS):
        hf_id = specials.get(name)
        note = "" if hf_id in (None, first + i) else f" (tokenizer.json has {hf_id})"
        print(f"  {name} -> {first + i}{note}")
    dropped = sorted(set(specials) - set(TIKTOKEN_SPECIALS))
    if dropped:
        print(f"  {len(dropped)} other added tokens not in the ranks file, e.g. {dropped[:3]}")
    if pattern != QWEN_PATTERN:
        print(f"warning: its pre-tokenizer regex differs from Qwen's: {pattern!r}")


if __name__ == "__main__":
    main()
