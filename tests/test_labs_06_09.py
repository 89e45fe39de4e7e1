"""Labs 06-09 through the grader, one table: for each lab the untouched skeleton scores 0, the reference
full marks, and its classic mistake loses exactly the checks that describe it, with feedback that names
the mistake (so the checks can fail, and fail for the right reason). The mistake is graded together with the
reference and the skeleton (tests/lab_grading.py); the skeleton's own grading is under `grading_scale`.

    06-zero             forgetting the all-gather after the partitioned step
    07-hsdp             never all-reducing across the replica group (each node trains its own model)
    08-mixed-precision  all-gathering the fp32 masters and rounding afterwards (twice the bytes)
    09-tutel-pipeline   posting chunk k+1 only after computing chunk k (right numbers, nothing overlapped)
"""

import pytest
import torch
from lab_grading import LabGrading, check_named, verdict

FP32_GATHER = """            full = torch.empty(self.flat.padded_numel, dtype=torch.float32)
            handle = comm.all_gather(full, self.master.detach(), group=self.sharding.shard_group, async_op=True)
            handle.wait()
            self.flat.data.copy_(full)
            piece = full
"""
POST_NEXT = "        following = exchange(chunks[k + 1], group, names[0], k + 1, count) if k + 1 < count else None\n"
COMPUTE = "        y = compute(k, pending.wait())\n"

# lab -> (its checks: a short key -> the start of the check's name, maximum, the mistake:
#         (name, (old, new) in the reference, {check that must fail: a phrase its message must contain}))
LABS = {
    "06-zero": (
        {
            "bounds": "shard_bounds",
            "grads": "after one backward",
            "states": "the optimizer holds states",
            "parity": "parity",
            "bytes": "bytes per step",
        },
        8,
        (
            "no all-gather after the step",
            ("        comm.all_gather(self.flat.data, self.master.detach().clone(), group=self.group)\n", ""),
            {
                "parity": "only its own slice of the parameters changed",
                "bytes": "without the all-gather after the step",
            },
        ),
    ),
    "07-hsdp": (
        {
            "layout": "hsdp_layout",
            "groups": "make_groups",
            "grads": "after one backward",
            "parity": "parity",
            "bytes": "bytes across nodes",
        },
        8,
        (
            "no all-reduce across the replica group",
            ('        comm.all_reduce(out, op="avg", group=self.sharding.replica_group)\n', ""),
            {
                "grads": "the replicas were never averaged",
                "parity": "after 3 SGD steps",
                "bytes": "no byte crossed from node to node",
            },
        ),
    ),
    "08-mixed-precision": (
        {
            "gather": "unshard:",
            "reduce": "gradients are reduced",
            "add": "add_grad",
            "fp32": "the optimizer sees fp32",
            "close": "4 AdamW steps",
            "bytes": "bytes halved",
        },
        9,
        (
            "all-gather in fp32, round afterwards",
            (
                "            piece = self.master.detach().to(self.sharding.param_dtype)\n"
                "            handle = comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group,"
                " async_op=True)\n",
                FP32_GATHER,
            ),
            {"gather": "cast the fp32 master slice to param_dtype *before* the all-gather", "bytes": "should send"},
        ),
    ),
    "09-tutel-pipeline": (
        {
            "split": "split_capacity",
            "outputs": "outputs",
            "grads": "gradients",
            "overlap": "overlap on the trace",
            "traffic": "traffic",
            "hidden": "degree 4 on a capacity of 5",
        },
        9,  # 8 public points, 1 hidden
        (
            "post chunk k+1 after computing chunk k",
            (POST_NEXT + COMPUTE, COMPUTE + POST_NEXT),
            {"overlap": "was posted after chunk 1's experts had started"},
        ),
    ),
}


def lab(name: str) -> LabGrading:
    checks, maximum, _ = LABS[name]
    return LabGrading(name, maximum, checks)


@pytest.mark.grading_scale  # graded together below, every check "not implemented yet"
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LABS))
def test_untouched_skeleton_scores_zero(name, no_leftover_ranks):
    lab(name).assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LABS))
def test_reference_solution_scores_full_marks(name, no_leftover_ranks):
    lab(name).assert_reference_scores_full()


@pytest.fixture(scope="module")
def graded():
    """Each lab's reference, skeleton and classic mistake graded together, once per lab."""
    done = {}

    def of(name: str):
        if name not in done:
            mistake, change, _ = LABS[name][2]
            done[name] = lab(name).grade_together({mistake: change})
        return done[name]

    return of


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LABS))
def test_graded_together_the_reference_passes_and_the_skeleton_fails(name, graded, no_leftover_ranks):
    lab(name).assert_reference_passes_and_skeleton_fails(graded(name))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LABS))
def test_the_classic_mistake_is_named(name, graded, no_leftover_ranks):
    mistake, _, failing = LABS[name][2]
    lab(name).assert_loses_exactly(graded(name), mistake, failing)


ANSWERS = {  # lab -> (code that hands the work to the toolkit, the answer it uses)
    "06-zero": ("from toolkit.parallel.zero import wrap_zero2  # noqa: F401", "toolkit.parallel.zero"),
    "07-hsdp": (
        "from toolkit.parallel.fsdp_unit import sharding_groups  # noqa: F401",
        "toolkit.parallel.fsdp_unit:sharding_groups",
    ),
    "08-mixed-precision": (
        "MixedUnit.add_grad = FSDPUnit.add_grad  # the toolkit's own, not yours",
        "toolkit.parallel.fsdp_unit:FSDPUnit.add_grad",
    ),
    "09-tutel-pipeline": ("from toolkit.moe.pipeline import chunking  # noqa: F401", "toolkit.moe.pipeline"),
}


@pytest.mark.parametrize("name", list(LABS))
def test_the_toolkits_own_implementation_scores_zero(name, tmp_path):
    lab(name).assert_delegation_scores_zero(*ANSWERS[name], tmp_path)


# A second classic mistake per lab, judged without a launch: the contract and the judge run in the grader's process
# on what the ranks would have sent, built here from the check's own inputs and the lab's reference.
def _judge(lab_name: str, prefix: str, n: int, answer) -> str:
    message = verdict(check_named(lab(lab_name).lab, prefix), n, answer)
    assert message, "the check passed"
    return message


def test_06_summed_gradient_slices_are_named():
    from toolkit.grading import sibling

    checks = sibling(str(lab("06-zero").lab / "checks.py"), "checks.py")

    def summed(r, case, given):
        grads = [p.grad for p in checks.local(given[0]["seed"], 0).parameters()]
        full = checks.flat_of(grads, 2)
        shard = full.numel() // 2
        return {"full_left": [], "grad": 2 * full[r * shard : (r + 1) * shard]}

    assert "the ranks' gradients were summed, not averaged" in _judge("06-zero", "after one backward", 2, summed)


def test_07_swapped_groups_are_named():
    def swapped(r, case, given):
        world, f = given[0]["world_size"], given[0]["F"]
        shards = [list(range(node * f, (node + 1) * f)) for node in range(world // f)]
        replicas = [list(range(place, world, f)) for place in range(f)]
        return {"layout": [replicas, shards]}

    assert "the two are swapped" in _judge("07-hsdp", "hsdp_layout", 4, swapped)


def test_08_a_reduce_dtype_ignored_is_named():
    def in_bf16(r, case, given):  # the reduce-scatter the grader's relay carried, in bf16 whatever reduce_dtype said
        return {
            "dtypes": [{"name": "reduce_scatter", "args": {"dtype": "bfloat16", "group": [0, 1], "bytes_sent": 64}}]
        }

    message = _judge("08-mixed-precision", "gradients are reduced", 2, in_bf16)
    assert "reduce_dtype=float32" in message and "make the flat gradient buffer in reduce_dtype" in message


def test_09_chunks_of_capacity_over_degree_are_named():
    x = torch.arange(2 * 5 * 3.0).view(2, 5, 3)

    def floor_split(r, case, given):
        degree = given[0]["degree"]
        return {"raised": "ValueError"} if degree == 0 else {"chunks": list(x.split(max(1, 5 // degree), dim=1))}

    message = _judge("09-tutel-pipeline", "split_capacity", 2, floor_split)
    assert "3 chunks for a degree of 2" in message and "leaves a remainder chunk" in message
