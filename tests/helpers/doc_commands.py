"""The shell commands of the documentation's code blocks, as a reader would type them.

A code block is read when it is tagged bash / sh, or untagged and its first line starts with a
program (log lines and tables are not commands). In it: `\\` continuations are joined, `#`
comments dropped, `NAME=value` lines kept as shell variables for the page's later `$NAME`, a
here-document's body kept as the command's input, and `[...]` optional parts either taken
(`[--out DIR]`) or, when they hold `...`, dropped (`[--section.key value ...]`)."""

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```(\w*)\s*$")
LAPTOP = re.compile(r"<!-- laptop-path -->\s*```bash\n(.*?)```\s*<!-- /laptop-path -->", re.S)
PROGRAMS = ("./", "scripts/", "python", "bash", "torchrun", "ttablate-", "time ", "$", "sbatch")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# What a user puts in: OUT_DIR, X, ABLATION.toml, OUT/ep_dispatch, <peer folder>, ~/hf/...
PLACEHOLDER = re.compile(r"<[^>]*>|^~/|^/path/to/|(^|/)(?!README)[A-Z][A-Z0-9_]*(\.\w+)?(/|$)")


@dataclass
class Command:
    """One command line of a page: where it is, its environment prefix and its words."""

    page: str
    line: int
    env: dict[str, str]
    words: list[str]
    stdin: str | None = None
    text: str = field(default="", repr=False)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.search(word))


def comment_start(line: str, shell: bool = True) -> int | None:
    """Where `line`'s `#` comment starts, or None. A `#` inside quotes never starts one; with
    `shell`, neither does a `#` inside a word (`a#b` is one word to the shell; TOML has no such
    rule)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#" and (not shell or i == 0 or line[i - 1].isspace()):
            return i
    return None


def strip_comment(line: str) -> str:
    """`line` without its `#` comment (a `#` inside quotes, or inside a word, is kept)."""
    return line[: comment_start(line)].rstrip()


def _optional_parts(text: str) -> str:
    return re.sub(r"\[([^\[\]]*)\]", lambda m: "" if "..." in m[1] else m[1], text)


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number of the first line, language, lines) of every fenced block."""
    blocks, current = [], None
    for n, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence and current is None:
            current = (n + 1, fence[1], [])
        elif fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    return blocks


def _is_shell(language: str, lines: list[str]) -> bool:
    first = next((x.strip() for x in lines if x.strip()), "")
    return language in ("bash", "sh") or (language == "" and first.startswith(PROGRAMS))


def _logical_lines(lines: list[str], first: int) -> list[tuple[int, str, str | None]]:
    """(line number, joined line, here-document body) of a shell block."""
    out, i = [], 0
    while i < len(lines):
        start, text = first + i, strip_comment(lines[i])
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + strip_comment(lines[i]).strip()
        body = None
        heredoc = re.search(r"<<-?'?(\w+)'?\s*$", text)
        if heredoc:
            end = lines.index(heredoc[1], i + 1)
            body, text, i = "\n".join(lines[i + 1 : end]), text[: heredoc.start()], end
        if text.strip():
            out.append((start, text.strip(), body))
        i += 1
    return out


def _expand(words: list[str], variables: dict[str, str]) -> list[str]:
    out = []
    for word in words:
        name = word[1:] if word.startswith("$") else None
        out += shlex.split(variables[name]) if name in variables else [word]
    return out


def markdown_commands(text: str, name: str) -> list[Command]:
    """The commands of a page's text; `name` names the page in each command's id."""
    commands, variables = [], {}
    for first, language, lines in code_blocks(text):
        if not _is_shell(language, lines):
            continue
        for n, text, body in _logical_lines(lines, first):
            words = shlex.split(_optional_parts(text))
            env = {}
            while words and ASSIGN.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if not words:  # NAME="..." alone: a variable the page's later commands use
                variables.update(env)
                continue
            words = _expand(words[1:] if words[0] == "time" else words, variables)
            commands.append(Command(name, n, env, words, body, text))
    return commands


def all_commands() -> list[Command]:
    pages = [(page.read_text(), str(page.relative_to(ROOT))) for page in PAGES]
    return [c for text, name in pages for c in markdown_commands(text, name)]


def laptop_commands(text: str) -> list[str]:
    """The laptop path's commands (between the laptop-path markers), continuations joined."""
    (block,) = LAPTOP.findall(text)
    return [line for _, line, _ in _logical_lines(block.splitlines(), 1)]
