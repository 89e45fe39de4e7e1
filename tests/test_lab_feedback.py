"""What the labs tell a student: lab 01 names the commonest ring mistakes instead of printing floats, and
the labs' READMEs say what really happens (which world sizes each check runs at, where the lesson is).

No ranks are launched: the checks are called in this process with a stand-in student whose results
are those of a mistaken ring, computed from the same inputs the check builds."""
import re
from pathlib import Path

import pytest
import torch

from toolkit.grading.grader import lab_checks, load_module
from toolkit.grading.checks import CheckFailed, Context

LABS = Path(__file__).resolve().parent.parent / "labs"
RING = LABS / "01-ring-allreduce"


@pytest.fixture(scope="module")
def ring_checks():
    return load_module(RING / "checks.py", "lab01_checks_under_test")


def _by_name(prefix):
    (found,) = [c for c in lab_checks(RING) if c.name.startswith(prefix)]
    return found


def _fails(check, student, rank=0, n=3) -> str:
    with pytest.raises(CheckFailed) as failure:
        check.fn(student, Context(rank=rank, world_size=n, group=None))
    return str(failure.value)


class LectureRing:
    """A reduce-scatter that leaves rank r with the finished chunk r+1 (the lecture's convention)."""

    def __init__(self, checks, n, rank, shift=1):
        self.checks, self.n, self.rank, self.shift = checks, n, rank, shift

    def reduce_scatter(self, output, input, op, group, async_op):
        xs = self.checks.inputs(self.n, input.numel(), seed=2)  # the check's own inputs
        output.copy_(torch.stack(xs).sum(0).tensor_split(self.n)[(self.rank + self.shift) % self.n])

    def all_gather(self, output, input, group, async_op):
        xs = self.checks.inputs(self.n, input.numel(), seed=1)
        blocks = [x.view_as(input) for x in xs]
        output.copy_(torch.cat([blocks[(k + self.shift) % self.n] for k in range(self.n)]))


def test_a_shifted_reduce_scatter_is_named_with_the_lectures_convention(ring_checks):
    message = _fails(_by_name("reduce-scatter"), LectureRing(ring_checks, 3, rank=0))
    assert "rank 0: chunk 0 holds the finished chunk 1" in message and "the lecture's convention" in message
    assert "got [" not in message  # no random-looking floats
    other = _fails(_by_name("reduce-scatter"), LectureRing(ring_checks, 4, rank=2, shift=2), rank=2, n=4)
    assert "chunk 2 holds the finished chunk 0" in other and "off by [2]" in other


def test_a_shifted_all_gather_names_the_blocks(ring_checks):
    message = _fails(_by_name("all-gather"), LectureRing(ring_checks, 3, rank=1), rank=1)
    assert "block 0 holds rank 1's input" in message and "shifted by 1" in message


def test_an_all_reduce_whose_chunks_were_never_finished(ring_checks):
    """A reduce-scatter a step short (or on the lecture's indices) feeds the all-gather unfinished chunks:
    each chunk k then holds rank k's own input only."""
    n, numel = 3, 12
    xs = ring_checks.inputs(n, numel)
    unfinished = torch.cat([xs[k].tensor_split(n)[k] for k in range(n)])
    positions = dict(enumerate(unfinished.tensor_split(n)))
    said = ring_checks.explain_chunks(xs, ring_checks.SUM, False, positions, me=0)
    assert said.startswith("chunk 0 is reduced over ranks [0] only; chunk 1 is reduced over ranks [1] only")
    assert "a step short" in said and "the lecture's convention" in said
    one_step_short = [xs[0].tensor_split(n)[k] + xs[1].tensor_split(n)[k] for k in range(n)]
    said = ring_checks.explain_chunks(xs, ring_checks.SUM, False, dict(enumerate(one_step_short)), me=0)
    assert "reduced over ranks [0, 1] only" in said
    noise = dict(enumerate(torch.randn(numel).tensor_split(n)))  # not a recognisable mistake: the numbers speak
    assert ring_checks.explain_chunks(xs, ring_checks.SUM, False, noise, me=0) is None


def test_lab01_readme_lists_each_checks_points_and_world_sizes():
    readme = (RING / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d, ]+) \| (.+) \|$", readme, re.M)
    checks = lab_checks(RING)
    assert len(rows) == len(checks), rows
    for (points, sizes, text), check in zip(rows, checks):
        assert int(points) == check.points, (text, check.name)
        assert tuple(int(s) for s in sizes.split(",")) == check.world_sizes, (text, check.name, check.world_sizes)
    assert f"{sum(c.points for c in checks)} points in all" in readme


def test_lab05_readme_points_to_the_lessons_shadowing_section():
    readme = (LABS / "05-shadowing" / "README.md").read_text()
    section, part = re.search(r'\(section (\d+), "([^"]+)", under "([^"]+)"\)', readme.replace("\n", " ")).group(1, 3)
    lesson = (LABS.parent / "notebooks" / "06-moe-systems.py").read_text()
    headings = re.findall(r"^# #+ (.+)$", lesson, re.M)
    assert any(h.startswith(f"{section}. ") and "imbalance" in h for h in headings), headings
    assert any(h.startswith(part.split(" chose")[0]) for h in headings), (part, headings)
