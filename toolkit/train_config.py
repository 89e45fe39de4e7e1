"""What defines a training run: `TrainConfig`, checked when it is made and against a world size before launching.

A config is plain data (saved in every Run, so a figure can say what it shows): the strategy and its options,
the tiny GPT's shape, the synthetic corpus, the global batch and its micro-batches, the optimizer. Its checks
speak the config's own words (`TrainConfig.lr must be ...`), and `check_world` says before any process starts
whether the global batch divides over the data-parallel replicas a world size gives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from . import parallel
from .models import GPTConfig
from .parallel.zero import ZERO1_REDUCES_ONCE

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@dataclass
class TrainConfig:
    """Everything that defines a training run; saved in the Run so a figure can say what it shows.

    strategy: a name from `toolkit.parallel.STRATEGIES`; options: that strategy's own (bucket size,
    mixed precision, ...). model: overrides for `tiny_gpt` (n_layer, d_model, ...). vocab_size,
    seq_len, data_seed: the synthetic corpus (the model gets the same vocab_size and seq_len).
    global_batch_size: rows per optimizer step over all ranks; accumulation: micro-batches per step, all but
    the last inside the strategy's `no_sync()` (no_sync=False: every micro-batch's gradients reduced, as
    Composer runs FSDP).
    clip: max gradient norm, or None for no clipping. sample_memory: record the memory ledger at
    phase boundaries. progress: a progress bar on rank 0.
    """

    strategy: str = "local"
    steps: int = 20
    global_batch_size: int = 8
    accumulation: int = 1
    no_sync: bool = True
    model: dict = field(default_factory=dict)
    vocab_size: int = 64
    seq_len: int = 32
    data_seed: int = 0
    optimizer: str = "adamw"
    lr: float = 3e-3
    seed: int = 0
    clip: float | None = None
    options: dict = field(default_factory=dict)
    progress: bool = True
    sample_memory: bool = True

    def __post_init__(self):
        if self.strategy not in parallel.STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {sorted(parallel.STRATEGIES)}.")
        for name in ("steps", "global_batch_size", "accumulation", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}.")
        if self.global_batch_size % self.accumulation:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split into "
                f"accumulation={self.accumulation} equal micro-batches; use a multiple of it."
            )
        if not isinstance(self.no_sync, bool):
            raise ValueError(f"TrainConfig.no_sync must be True or False, got {self.no_sync!r}.")
        if self.strategy == "zero1" and self.accumulation > 1 and not self.no_sync:
            raise ValueError(
                f"TrainConfig.no_sync=False: {ZERO1_REDUCES_ONCE}: keep no_sync=True, or use strategy='zero2'."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}.")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}.")
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(f"TrainConfig.clip must be a positive max norm or None, got {self.clip!r}.")
        if not isinstance(self.model, dict) or not isinstance(self.options, dict):
            raise ValueError("TrainConfig.model and TrainConfig.options must be dicts.")
        fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size", "seq_len"}
        unknown = set(self.model) - fields
        if unknown:
            hint = (
                " (set TrainConfig.vocab_size / seq_len instead: the corpus and the model share them)"
                if unknown & {"vocab_size", "seq_len"}
                else ""
            )
            raise ValueError(
                f"TrainConfig.model has unknown key(s) {sorted(unknown)}{hint}; valid keys: {sorted(fields)}."
            )

    def check_world(self, world_size: int) -> None:
        """Each data-parallel replica's micro-batch must be whole rows: global_batch_size % (dp * accumulation)
        == 0, where dp = world_size / (tp x pp x cp) (the ranks of one tensor/pipeline/context-parallel group share
        rows); under pp the schedule's `microbatches` (default pp) take the place of accumulation. Under cp the
        sequence must split into the cp ranks' chunks."""
        dp, _ = self.data_parallel(world_size)
        if self.options.get("cp", 1) > 1:
            from .parallel.context import SequenceSplit

            attention = self.options.get("cp_attention", "ring")
            SequenceSplit(self.options["cp"], 0, zigzag=attention == "ring").check(self.seq_len, "TrainConfig.seq_len")
        pp = self.options.get("pp", 1)
        if pp > 1 and self.accumulation != 1:
            raise ValueError(
                f"under pp={pp} the pipeline's schedule splits each replica's batch into micro-batches "
                f"(options['microbatches']): leave accumulation at 1 (got {self.accumulation})."
            )
        per = dp * (self.options.get("microbatches") or pp if pp > 1 else self.accumulation)
        if self.global_batch_size % per:
            ranks = f"world_size={world_size}" if dp == world_size else f"dp={dp} replicas (world {world_size})"
            split = f"microbatches={per // dp}" if pp > 1 else f"accumulation={self.accumulation}"
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not divide over {ranks} x "
                f"{split} = {per} micro-batches; use a "
                f"multiple of {per}, e.g. {per * max(1, self.global_batch_size // per)}."
            )

    def data_parallel(self, world_size: int, rank: int = 0) -> tuple[int, int]:
        """(dp, this rank's dp index): the world is dp x pp x cp x tp (`options` tp=, pp=, cp=, order=), and a rank
        reads the rows of its data-parallel replica, the same rows as every rank of its tp, pp and cp groups (a cp
        rank keeps its own tokens of them)."""
        from .parallel import mesh

        o = self.options
        layout = mesh.layout(
            world_size, tp=o.get("tp", 1), pp=o.get("pp", 1), cp=o.get("cp", 1), order=o.get("order", mesh.ORDER)
        )
        return layout.dp, layout.coordinate(rank).dp

    @classmethod
    def of(cls, config) -> TrainConfig:
        """A TrainConfig from a TrainConfig or a dict (a Run's `config`)."""
        return config if isinstance(config, cls) else cls(**dict(config))
