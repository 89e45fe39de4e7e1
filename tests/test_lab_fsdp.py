"""Lab 03 (one FSDP unit) through the grader: the untouched skeleton scores 0, the reference full marks,
and each classic mistake loses exactly the points of the checks that describe it."""
from pathlib import Path

import pytest

from toolkit.grading import format_score, grade

LAB = Path(__file__).resolve().parent.parent / "labs" / "03-fsdp-unit"
MAXIMUM = 11
CHECKS = {  # a short key -> the start of the check's name in checks.py
    "unshard": "unshard:",
    "freed": "reshard frees",
    "trace": "per step, every unit",
    "bytes": "bytes on the wire",
    "grads": "after one backward",
    "parity": "parity with 'local'",
}


def by_key(score):
    results = {}
    for key, prefix in CHECKS.items():
        found = [r for r in score.results if r.name.startswith(prefix)]
        assert len(found) == 1, f"no single check named {prefix!r}: {[r.name for r in score.results]}"
        results[key] = found[0]
    assert len(results) == len(score.results)
    return results


@pytest.mark.timeout(90)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    score = grade(LAB)
    assert score.maximum == MAXIMUM and score.total == 0, format_score(score)
    for result in score.results:
        assert "not implemented yet" in result.message, result


@pytest.mark.timeout(90)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    score = grade(LAB, LAB / "solution.py")
    assert score.total == score.maximum == MAXIMUM, format_score(score)


# (name, what to change in the reference, checks that must fail, a phrase their message must contain)
MISTAKES = [
    ("reshard never frees the memory",
     ("        self.flat.data.untyped_storage().resize_(0)\n", ""),
     {"freed": "still holds"}),
    ("reduce-scatter sums instead of averaging",
     ('op="avg", group=self.sharding.shard_group', 'op="sum", group=self.sharding.shard_group'),
     {"grads": "the ranks' gradients were summed, not averaged", "parity": "SGD steps"}),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name, change, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_loses_the_matching_points(tmp_path, name, change, failing, no_leftover_ranks):
    reference = (LAB / "solution.py").read_text()
    old, new = change
    assert reference.count(old) == 1, f"the reference no longer contains {old!r}: update this test"
    broken = tmp_path / "broken.py"
    broken.write_text(reference.replace(old, new))
    score = grade(LAB, broken)
    results = by_key(score)
    for key, result in results.items():
        if key in failing:
            assert result.earned == 0, f"{name}: check {key!r} should fail\n{format_score(score)}"
            assert failing[key] in result.message, f"{name}: {key!r} says {result.message!r}"
        else:
            assert result.passed, f"{name}: check {key!r} should still pass\n{format_score(score)}"
    assert score.total == MAXIMUM - sum(results[k].points for k in failing)
