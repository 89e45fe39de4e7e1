"""Mixture-of-Experts under tensor parallelism: the tensor-parallel ranks share out the tokens, and the
experts are split over every rank of the world, with the expert parallelism the toolkit already has.

Inside a tensor-parallel group every rank holds the same tokens. Cutting each expert's FFN over the
group as Megatron cuts a dense MLP (column then row, an all-reduce of the layer's output) would work, but
the toolkit already knows a better use of those ranks (`toolkit.moe`): give each rank *different* tokens
and let the expert-parallel layer send them to their experts. So here:

1. the group's tokens are split t ways (`scatter_to_tp`, no talk; under sequence parallelism they are
   split along the sequence already, and nothing moves at all);
2. the MoE layer runs unchanged on this rank's share, over the whole world as its expert-parallel group:
   W = dp·t ranks hold E experts, whole ones when W <= E, or each expert sliced over W/E ranks when W > E,
   which is Tutel's EP+DP+MP (`moe/sharded.py`, expert_slices = Tutel's r). That slicing is the expert's
   own tensor parallelism: its hidden layer cut in slices whose partial outputs the sender adds up, the
   column/row split of `linear.py` with an all-to-all where Megatron has an all-reduce;
3. the outputs are all-gathered back (`gather_from_tp`) into the tokens every rank holds.

What is replicated and computes on a share of the tokens gets its gradient summed over the group: the
router (f in front of its weight while the layer runs, `sequence.summed_gradients`). Each rank's
load-balancing loss is over its share; the layer returns their mean over the group (g / t), the same on
every rank, as data parallelism averages the ranks' losses. The experts' gradients need nothing: the
all-to-all's backward already brings every token's contribution to the expert's owner, and the
data-parallel strategy divides them by dp as ever.

Exactness: with t = 2 and the batch split by rows, this rank's share is half the batch's rows, so a
step equals one process accumulating two micro-batches (same capacities, same auxiliary losses).
"""

from __future__ import annotations

import torch

from ...moe.layer import MoE
from .operators import TPGroup, gather_from_tp, reduce_from_tp, scatter_to_tp
from .sequence import summed_gradients


class TensorParallelMoE(MoE):
    """An MoE layer inside a tensor-parallel group (the class changes in place, names stay)."""

    tp: TPGroup
    tokens_split: bool  # False under sequence parallelism: the input is this rank's share already

    def forward(self, x: torch.Tensor):
        with summed_gradients(self.gate.router, self.tp):  # the router sees a share of the tokens
            if self.tokens_split:
                out, aux = super().forward(x)
            else:
                tokens = scatter_to_tp(x.reshape(-1, x.shape[-1]), self.tp, 0)
                out, aux = super().forward(tokens)
                out = gather_from_tp(out, self.tp, 0).reshape(x.shape)
        return out, reduce_from_tp(aux, self.tp) / self.tp.size


def split_moe(moe: MoE, tp: TPGroup, sequence_parallel: bool) -> MoE:
    """Put an MoE layer under tensor parallelism, in place."""
    moe.__class__ = TensorParallelMoE
    moe.tp, moe.tokens_split = tp, sequence_parallel
    return moe
