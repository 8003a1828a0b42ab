"""The files a student reads to follow EMPO² stay readable: no function longer than a screen."""
import ast

import pytest

from tests.conftest import ROOT

LIMIT, MAIN_LIMIT = 50, 65   # lines, docstring included; train.main holds the whole iteration


def long_functions(source: str, limit: int, exceptions: dict[str, int]) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > exceptions.get(node.name, limit):
                out.append((node.name, length))
    return out


@pytest.mark.parametrize("name", ["empo2.py", "memory.py", "train.py"])
def test_no_function_on_the_reading_path_is_longer_than_a_screen(name):
    exceptions = {"main": MAIN_LIMIT} if name == "train.py" else {}
    assert long_functions((ROOT / name).read_text(), LIMIT, exceptions) == []


def test_the_length_check_catches_a_long_function():
    body = "\n".join(f"    x{k} = {k}" for k in range(LIMIT))
    assert long_functions(f"def f():\n{body}\n", LIMIT, {}) == [("f", LIMIT + 1)]


def test_every_config_field_has_the_docstring_its_help_comes_from():
    from dataclasses import fields

    from empo2 import Config, config_help
    docs = config_help()
    assert set(docs) == {f.name for f in fields(Config)}
    assert all(len(text) > 5 for text in docs.values())
