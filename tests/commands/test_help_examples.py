"""The example commands that open every command's and benchmark's docstring, which ``--help``
prints as is, are whole shell commands: a command wrapped onto a second line carries a
trailing backslash, and no line runs two commands together."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    [*(ROOT / "qmoe_jax").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")],
    key=lambda path: str(path),
)
COMMAND = re.compile(r"(python3?|git|taskset|bash|pip|\.ci/\S+)(\s|$)")


def broken_example_lines(doc: str) -> list[str]:
    """Lines of the indented examples in ``doc`` that are not whole commands: the unescaped tail
    of a wrapped command, or a command with another one (or a stray backslash) inside it."""
    broken = []
    lines = doc.splitlines()
    for number, line in enumerate(lines):
        text = line.strip()
        previous = lines[number - 1] if number else ""
        if not line.startswith("    ") or not text or previous.rstrip().endswith("\\"):
            continue
        if COMMAND.match(text):
            code = text.split("  #")[0]
            if re.search(r"\s\\\s", code) or re.search(r"[^\s&|;]\s+python3? -m ", code):
                broken.append(text)
        elif (
            previous.startswith("    ")
            and COMMAND.match(previous.strip())
            and not text.startswith("#")
        ):
            broken.append(text)
    return broken


def test_finds_the_ways_a_rewrap_breaks_an_example():
    doc = "\n".join(
        [
            "Title.",
            "",
            "    python -m qmoe_jax.evaluate   # the bundled model on its held-out validation",
            "    plays python -m qmoe_jax.evaluate --checkpoint runs/x",
            "    python -m qmoe_jax.generate --checkpoint runs/x --prompt",
            '    "..."',
            "    python -m qmoe_jax.compress --num_samples 8 \\ --output_dir runs/y",
            "    python -m qmoe_jax.export --checkpoint runs/x \\",
            "        --output_dir runs/z",
            "    pip install . && python -m qmoe_jax.compress",
            "    python benchmarks/quality.py --amounts 1   # a comment",
            "                                               # that goes on",
        ]
    )
    assert broken_example_lines(doc) == [
        "plays python -m qmoe_jax.evaluate --checkpoint runs/x",
        '"..."',
        "python -m qmoe_jax.compress --num_samples 8 \\ --output_dir runs/y",
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_help_examples_are_whole_commands(script):
    doc = ast.get_docstring(ast.parse(script.read_text()), clean=False) or ""
    assert broken_example_lines(doc) == []
