"""The mutation run of the labs' references (toolkit/grading/mutation.py, mutants.py): which mutants the mutator
makes (only in what a student writes, one change each, every one a different program), and a few of lab 12's graded
through the runner, many to a launch, with the table written as `make test-mutants` writes it. The whole run, every
lab, is `make test-mutants` (about half an hour on 2 loaded cores)."""

import ast
import re

import pytest
from lab_grading import LABS

from toolkit.grading import mutants as runner
from toolkit.grading.mutation import mutants, students_functions

SKELETON = '''
def given(x):
    return x + 1


def yours(x, group):
    """What the student writes."""
    raise NotImplementedError("yours")
'''
SOLUTION = '''
def given(x):
    return x + 1


def helper(n):
    return (n - 1) % n


def yours(x, group):
    """What the student writes."""
    handle = comm.all_reduce(x, op="avg", group=group, async_op=True)
    handle.wait()
    return x[helper(4)] / 2 if x.numel() > 1 else x
'''


def test_only_what_a_student_writes_is_mutated_one_change_at_a_time():
    assert students_functions(ast.parse(SOLUTION), ast.parse(SKELETON)) == {"helper", "yours"}
    found = mutants(SOLUTION, SKELETON)
    whats = {m.what for m in found}
    for expected in (
        "`'avg'` -> `'sum'`",
        "`True` -> `False`",
        "`handle.wait()` left out",
        "`-` -> `+` in `n - 1`",
        "`x[helper(4)] / 2` -> `x[helper(4)]`",
        "`4` -> `5`",
        "`>` -> `>=` in `x.numel() > 1`",
        "`%` -> `//` in `(n - 1) % n`",
    ):
        assert expected in whats, (expected, sorted(whats))
    assert {m.function for m in found} == {"helper", "yours"}  # `given` is the lab's, not the student's
    sources = [m.source for m in found]
    assert len(set(sources)) == len(sources)  # no program twice
    reference = ast.dump(ast.parse(SOLUTION))
    for m in found:
        tree = ast.parse(m.source)
        assert ast.dump(tree) != reference and "what the student writes" in m.source.lower()  # docstrings untouched
        assert re.match(r"(helper|yours) line \d+: ", m.id)


def test_every_lab_has_mutants_with_distinct_ids():
    for lab in sorted(p for p in LABS.iterdir() if (p / "solution.py").exists()):
        found = runner.lab_mutants(lab)
        assert len(found) >= 10 and len({m.id for m in found}) == len(found), lab.name
        for why in runner.equivalents(lab):
            assert why in {m.id for m in found}, f"{lab.name}/equivalent_mutants.md names no mutant: {why}"


QUICK = (
    "`actions.append(Action('F', warmup + i, rank))` left out",
    "`actions.append(Action('B', i, rank))` left out",
    "`'F'` and `i` swapped in `Action('F', i, rank)`",
)  # three the first check kills: one launch


@pytest.mark.timeout(600)
def test_a_few_of_lab12s_mutants_are_graded_many_to_a_launch_and_tabled(tmp_path, no_leftover_ranks):
    lab = LABS / "12-pipeline"
    chosen = {m.id for m in runner.lab_mutants(lab) if m.what in QUICK}
    assert len(chosen) == 3
    result = runner.run_lab(lab, chosen)
    assert set(result.killed) == chosen and not result.survivors and result.score == 1.0
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- mutants -->\nold\n<!-- /mutants -->\nafter\n")
    runner.write_table(readme, runner.table([result]))
    text = readme.read_text()
    assert re.search(r"^\| 12-pipeline \| 3 \| 3 \| 0 \| 0 \| 100% \| \d+ s \|$", text, re.M), text
    assert text.startswith("before\n<!-- mutants -->\n| lab |") and text.endswith("<!-- /mutants -->\nafter\n")


def test_the_command_line_says_what_is_wrong(capsys):
    assert runner.main([str(LABS), "--labs", "99-no-such-lab"]) == 2
    assert "no lab named ['99-no-such-lab']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no <!-- mutants -->"):
        runner.write_table(LABS / "12-pipeline" / "README.md", "| table |\n")
