"""Lab 08 (mixed precision in FSDP) through the grader: the untouched skeleton scores 0, the reference
full marks, and the classic mistake (all-gather the fp32 masters, then round) loses exactly the checks
that describe it, with feedback that names it."""
import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "gather": "unshard:",
    "reduce": "gradients are reduced",
    "fp32": "the optimizer sees fp32",
    "close": "4 AdamW steps",
    "bytes": "bytes halved",
}
LAB = LabGrading("08-mixed-precision", 8, CHECKS)


@pytest.mark.timeout(90)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(90)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


FP32_GATHER = """            full = torch.empty(self.flat.padded_numel, dtype=torch.float32)
            handle = comm.all_gather(full, self.master.detach(), group=self.sharding.shard_group, async_op=True)
            handle.wait()
            self.flat.data.copy_(full)
            piece = full
"""


@pytest.mark.timeout(90)
def test_gathering_fp32_then_rounding_is_named(tmp_path, no_leftover_ranks):
    LAB.assert_mistake_loses_exactly(
        "all-gather in fp32, round afterwards",
        ("            piece = self.master.detach().to(self.sharding.param_dtype)\n"
         "            handle = comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group, async_op=True)\n",
         FP32_GATHER),
        {"gather": "cast the fp32 master slice to param_dtype *before* the all-gather", "bytes": "should send"},
        tmp_path)
