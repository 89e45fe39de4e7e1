"""What the labs tell a student: lab 01 names the commonest ring mistakes instead of printing floats, and
the labs' READMEs say what really happens (which world sizes each check runs at, where the lesson is).

No ranks are launched: a check's judge runs in the grader's process on what the ranks would have sent, so
it is called here with the results of a mistaken ring, computed from the inputs the check draws."""

import re
from pathlib import Path

import pytest
import torch
from lab_grading import check_named, verdict

from toolkit.grading import lab_checks
from toolkit.grading.runner import load_module

LABS = Path(__file__).resolve().parent.parent / "labs"
RING = LABS / "01-ring-allreduce"


@pytest.fixture(scope="module")
def ring_checks():
    return load_module(RING / "checks.py", "lab01_checks_under_test")


def _by_name(prefix):
    return check_named(RING, prefix)


def _fails(check, n, got_of) -> str:
    """The grader's message when rank r answers each case with got_of(r, given) at world size n."""
    message = verdict(check, n, lambda r, case, given: got_of(r, given))
    assert message, "the check passed"
    return message


def lecture_scatter(n, shift=1):
    """A reduce-scatter that leaves rank r with the finished chunk r+shift (the lecture's convention)."""

    def got(r, given):
        return {
            "output": torch.stack([g["x"] for g in given]).sum(0).tensor_split(n)[(r + shift) % n],
            "input_after": given[r]["x"],
        }

    return got


def lecture_gather(n, shift=1):
    def got(r, given):
        return {"output": torch.cat([given[(b + shift) % n]["x"] for b in range(n)])}

    return got


def test_a_shifted_reduce_scatter_is_named_with_the_lectures_convention():
    message = _fails(_by_name("reduce-scatter"), 3, lecture_scatter(3))
    assert "rank 0: chunk 0 holds the finished chunk 1" in message and "the lecture's convention" in message
    assert "got [" not in message  # no random-looking floats
    other = _fails(_by_name("reduce-scatter"), 4, lecture_scatter(4, shift=2))
    assert "chunk 0 holds the finished chunk 2" in other and "off by [2]" in other


def test_a_shifted_all_gather_names_the_blocks():
    message = _fails(_by_name("all-gather"), 3, lecture_gather(3))
    assert "rank 0: block 0 holds rank 1's input" in message and "shifted by 1" in message


def test_an_all_reduce_whose_chunks_were_never_finished(ring_checks):
    """A reduce-scatter a step short (or on the lecture's indices) feeds the all-gather unfinished chunks:
    each chunk k then holds rank k's own input only."""
    n, numel = 3, 12
    g = torch.Generator().manual_seed(0)
    xs = [ring_checks.draw(g, numel) for _ in range(n)]
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


def test_traffic_off_the_ring_is_named():
    check = _by_name("a real ring")

    def star(r, given):  # every rank sends its whole tensor to rank 0: the sum arrives, not through a ring
        total = sum(g["x"] for g in given)
        return {
            "x": total,
            "messages": [["send", 0, total.numel()]] if r else [["recv", s, total.numel()] for s in range(1, 3)],
        }

    message = _fails(check, 3, star)
    assert "rank 0 (left neighbour 2, right neighbour 1) also posted a recv with rank 1" in message, message


def test_lab01_readme_lists_each_checks_points_and_world_sizes():
    readme = (RING / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d, ]+) \| (.+) \|$", readme, re.M)
    checks = lab_checks(RING)[0]
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
