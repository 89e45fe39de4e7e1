"""docs/differences.md is the one list of where the toolkit departs from torch and DeepSpeed: it covers
every dense strategy, and the lessons that teach them link to it."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "differences.md")


def headings() -> list[str]:
    with open(PAGE, encoding="utf-8") as f:
        return re.findall(r"^## (.+)$", f.read(), flags=re.MULTILINE)


def test_every_dense_strategy_and_shared_piece_has_a_section():
    found = " | ".join(headings())
    for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP", "Mixed precision", "Training loop", "Checkpoints",
                 "Activations"):
        assert name in found, f"docs/differences.md has no section for {name}: {found}"


def test_every_table_row_says_what_why_and_what_you_notice():
    with open(PAGE, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| ") and not line.startswith("| ---")]
    header = "| What the toolkit does | Why | What you would notice |"
    for row in rows:
        assert row.strip() == header or row.count(" | ") >= 2, f"a row without its three columns: {row[:80]}"


def test_lessons_02_to_04_link_to_the_page():
    for lesson in ("02-data-parallel", "03-zero", "04-fsdp"):
        with open(os.path.join(ROOT, "notebooks", f"{lesson}.py"), encoding="utf-8") as f:
            assert "docs/differences.md" in f.read(), f"notebook {lesson} does not link docs/differences.md"
