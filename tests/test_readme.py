"""The README's library example runs as printed; its Quick start stays the two commands, short."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(section: str) -> str:
    text = README.read_text()
    start = text.index(f"## {section}")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_readme_library_example_runs_and_meets_the_budget():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_python_block("Use the library"), "README.md", "exec"), {})
    bits, unquantized, shape = out.getvalue().strip().splitlines()[-3:]
    average, average_all = map(float, bits.split())
    assert 2.9 < average <= 3.0 and average <= average_all < 3.5  # every weight of this model is quantised
    assert unquantized == "{}" and shape == "torch.Size([2, 10])"


def test_readme_quick_start_is_the_two_commands_in_at_most_80_words():
    text = README.read_text()
    start = text.index("## Quick start")
    section = text[start + len("## Quick start"):text.index("\n## ", start + 1)]
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert [line.split()[:2] for line in commands.strip().splitlines()] == [["make", "run"], ["make", "test"]]
    assert len(section.split()) <= 80
