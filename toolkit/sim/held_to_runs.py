"""How predictions on the GPU presets have fared against published training runs that priced nothing in them.

A student who asks what a run would take on 512 H100s gets a number from published measurements of the hardware; this
says, beside it (`StepCost.trust`), how far such numbers have been from runs that happened: each run's step over the
predicted one, by group of runs (bench/published_runs.py and bench/megatron_table.py print them; docs/differences.md
says what each run paid that the model does not price). Stated, never charged: a factor fitted to these runs would be
tuned to the very runs the model is held to. tests/test_sim_papers.py holds every run inside its group's range.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware_presets import CLUSTERS


@dataclass(frozen=True)
class Group:
    """Published runs of one kind, and what each run's step took over the predicted one (lowest, highest)."""

    what: str
    runs: tuple[str, ...]  # the runs' names in bench/published_runs.py ("megatron-table-1-row-N": Table 1's rows)
    took: tuple[float, float]
    why: str = ""

    def covers(self, error: float) -> bool:
        """Whether a run predicted `error` off (predicted rate over the run's, less one) lies in the range, as
        rounded to the hundredth it is stated at."""
        return round(self.took[0] - 0.005, 3) <= 1 + error <= round(self.took[1] + 0.005, 3)

    def text(self) -> str:
        low, high = self.took
        why = f" ({self.why})" if self.why else ""
        return f"{self.what}: each took {low:.2f}x to {high:.2f}x the predicted step{why}"


TABLE_1 = tuple(f"megatron-table-1-row-{i}" for i in range(1, 11))
PRESETS = {
    "dgx-a100": (
        Group(
            "Megatron-LM's Table 1 as its artifact ran (32 to 3,072 A100s), llm-foundry's MPT-1B, 7B and 13B, "
            "fms-fsdp's Llama 2 7B, 13B, 34B and 70B, torchtitan's Llama 2 13B and 70B and Llama 3 8B and 70B (every "
            "layer, every second one or by operation recomputed, or none), BigScience's "
            "BLOOM-176B (384 A100s, Megatron-DeepSpeed) and flash-attention's GPT3-2.7B (8 A100s, DDP with ZeRO-1)",
            TABLE_1
            + ("mpt-1b-a100", "mpt-7b-a100", "mpt-13b-a100", "llama2-7b-a100", "llama2-13b-a100")
            + ("llama3-70b-a100", "llama2-70b-a100", "bloom-176b-a100", "fa2-gpt3-2.7b-a100")
            + ("fms-llama-13b-a100", "fms-llama-34b-a100", "fms-llama-70b-a100")
            + ("llama2-13b-ac2-a100", "llama3-8b-ac2-a100", "llama3-8b-op-a100", "llama2-13b-op-a100")
            + ("llama2-70b-op-a100",),
            (0.96, 1.15),
        ),
        Group(
            "Korthikanti et al.'s Megatron-LM runs of 2022 (8 to 2,240 A100s at tp 8, up to 64 pipeline stages; every "
            "layer recomputed, or sequence parallelism with the core attention recomputed)",
            tuple(
                f"korthikanti-{name}-{how}" for name in ("22b", "175b", "530b", "1t") for how in ("full", "selective")
            )
            + ("korthikanti-530b-dp8-selective",),
            (0.92, 0.99),
            "each ran faster than priced, where Table 1, the same code a year earlier, ran as fast or slower: "
            "docs/differences.md, 'Sequence parallelism and selective recomputation, held to the paper's runs'",
        ),
    ),
    "dgx-h100": (
        Group(
            "llm-foundry's MPT-1B, 7B and 13B and fms-fsdp's Llama 2 7B, 13B, 34B and 70B (FSDP, 8 to 96 H100s)",
            ("mpt-1b-h100", "mpt-7b-h100", "mpt-13b-h100", "llama2-7b-h100")
            + ("fms-llama-13b-h100", "fms-llama-34b-h100", "fms-llama-70b-h100"),
            (1.22, 1.36),
            "their compute ran slower than the benchmarks the H100 is priced from; each one's A100 twin is met, and "
            "the model's H100 speedup over it is 1.14-1.19x the runs': docs/differences.md, 'The H100 gap'",
        ),
        Group(
            "Megatron-Core's 1.7B, 7.1B and 16B weak-scaling rows (48 to 192 H100s)",
            ("mcore-1.7b-h100", "mcore-7.1b-h100", "mcore-16b-h100"),
            (1.05, 1.22),
            "priced with their tensor- and data-parallel traffic hidden as the runs hid it (1-5% of their steps "
            "exposed): what remains is their compute, at the H100 level the FSDP runs show",
        ),
        Group(
            "flash-attention's GPT3-2.7B (8 H100s, DDP with ZeRO-1, fp16 autocast)",
            ("fa2-gpt3-2.7b-h100",),
            (1.21, 1.21),
            "its A100 twin took 1.03x: the FSDP pairs' H100 level in a third software stack",
        ),
    ),
}


def note(cluster) -> str | None:
    """The record for `cluster`'s predictions, where it is a preset with the preset's GPU (a what-if on another GPU
    has none); None elsewhere."""
    preset = CLUSTERS.get(cluster.name)
    if cluster.name not in PRESETS or preset is None or cluster.gpu != preset.gpu:
        return None
    groups = PRESETS[cluster.name]
    runs = sum(len(g.runs) for g in groups)
    return f"held to {runs} published training runs ({cluster.name}): " + "; ".join(g.text() for g in groups)


def group_of(run: str, cluster: str) -> Group:
    """The group `run` (a name as in `Group.runs`) belongs to on preset `cluster`."""
    return next(g for g in PRESETS[cluster] if run in g.runs)
