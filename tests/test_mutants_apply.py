"""The mutation check's mutants (tests/mutants.py) still apply to the code: each snippet occurs exactly once in its
file. A refactor that moves a snippet otherwise goes unnoticed until someone runs ./launch/mutation.sh, which then
reports the mutant as not applying instead of running it (six decode-attention mutants went stale that way)."""

from pathlib import Path

import pytest

from tests.mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[1]


def test_mutant_names_are_unique():
    names = [m["name"] for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m["name"] for m in MUTANTS])
def test_each_mutant_snippet_occurs_once_in_its_file(mutant):
    text = (ROOT / mutant["file"]).read_text()
    n = text.count(mutant["old"])
    assert n == 1, f"{mutant['name']}: its snippet occurs {n} times in {mutant['file']}: update it (never drop it)"
    assert mutant["new"] != mutant["old"] and mutant["tests"], mutant["name"]
