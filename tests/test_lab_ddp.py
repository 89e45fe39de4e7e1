"""Lab 02 (DDP gradient buckets) through the grader: the untouched skeleton scores 0, the reference full
marks, and each classic mistake loses exactly the points of the checks that describe it, so the
checks can fail, and fail for the right reason."""
from pathlib import Path

import pytest

from toolkit.grading import format_score, grade

LAB = Path(__file__).resolve().parent.parent / "labs" / "02-ddp-buckets"
MAXIMUM = 10
CHECKS = {  # a short key -> the start of the check's name in checks.py
    "assign": "assign_buckets",
    "model_buckets": "a small cap on the tiny GPT",
    "grads": "after one backward",
    "parity": "parity with 'local'",
    "overlap": "overlap",
    "bytes": "bytes on the wire",
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
    ("buckets in forward order",
     ("for index in reversed(range(len(params))):", "for index in range(len(params)):"),
     {"assign": "reverse registration order", "model_buckets": "should start with 'ln_f.bias'",
      "overlap": "should already be travelling"}),
    ("waiting for each bucket inside the hook",
     ("            self.next_bucket += 1\n", "            launch.handle.wait()\n            self.next_bucket += 1\n"),
     {"overlap": "was waited for while backward was still running"}),
    ("summing instead of averaging",
     ('op="avg", group=self.group, async_op=True', 'op="sum", group=self.group, async_op=True'),
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
