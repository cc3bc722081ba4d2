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
import os
import sys
from pathlib import Path
from typing import NoReturn

from torchtitan_ablate.components.text.tokenizer import (
    QWEN_PATTERN,
    TIKTOKEN_SPECIALS,
    hf_tokenizer_json_to_ranks,
    save_tiktoken_ranks,
)


def _fail(message: str) -> NoReturn:
    print(f"convert_tokenizer: error: {(message.splitlines() or [''])[0]}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_json", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.tokenizer_json.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not a tokenizer.json object")
        ranks, specials, pattern = hf_tokenizer_json_to_ranks(data)
    except KeyError as e:
        _fail(f"cannot convert {args.tokenizer_json}: no {e} entry; is it a BPE tokenizer.json?")
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        _fail(f"cannot convert {args.tokenizer_json}: {e}")
    # Written beside the output and renamed: a failed write leaves no truncated ranks file.
    tmp = args.output.with_name(f".{args.output.name}.{os.getpid()}.tmp")
    try:
        save_tiktoken_ranks(ranks, tmp)
        os.replace(tmp, args.output)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _fail(f"cannot write {args.output}: {e.strerror or e}")
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
