"""scripts/convert_tokenizer.py: a bad tokenizer.json or output path is one line, exit code 2."""

import importlib.util

import pytest

from tests.helpers.hf_tokenizer import make_hf_tokenizer_json

SPEC = importlib.util.spec_from_file_location("convert_tokenizer", "scripts/convert_tokenizer.py")
convert_tokenizer = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(convert_tokenizer)


def error_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        convert_tokenizer.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("{not json", "Expecting property name"),
        ("[1, 2]", "a JSON list, not a tokenizer.json object"),
        ('{"model": {"type": "Unigram"}}', "only byte-level BPE"),
    ],
)
def test_bad_tokenizer_json(tmp_path, capsys, content, message):
    src = tmp_path / "tokenizer.json"
    if content is not None:
        src.write_text(content)
    line = error_line([str(src), str(tmp_path / "out.tiktoken")], capsys)
    assert line.startswith(f"convert_tokenizer: error: cannot convert {src}: ") and message in line
    assert not (tmp_path / "out.tiktoken").exists()


def test_unwritable_output_leaves_nothing(tmp_path, capsys):
    make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    out = tmp_path / "no" / "out.tiktoken"
    assert f"cannot write {out}" in error_line([str(tmp_path / "tokenizer.json"), str(out)], capsys)
    convert_tokenizer.main([str(tmp_path / "tokenizer.json"), str(tmp_path / "ok.tiktoken")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.tiktoken", "tokenizer.json"]
