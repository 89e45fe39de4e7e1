"""The plan of one exchange: who sends how many rows to whom (the result of the count exchange).

Its own file so that every way of running steps 4-6 (the plain layer, shadowing, Tutel's data-parallel
placement, the pipelined and smart schedules) can build one without importing the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    """Result of the count exchange. Rank r holds local experts r*E_local .. (r+1)*E_local - 1.

    send_counts (W, E_local)  rows this rank sends to rank j's local expert e (kept choices)
    recv_counts (W, E_local)  rows this rank receives from rank j for its local expert e
    send_splits, recv_splits  per-rank row totals (host ints: the all-to-all split sizes)
    """

    send_counts: torch.Tensor
    recv_counts: torch.Tensor

    def __post_init__(self):
        self.send_splits = self.send_counts.sum(1).tolist()
        self.recv_splits = self.recv_counts.sum(1).tolist()

    @property
    def expert_rows(self) -> list:
        """Rows each local expert computes, summed over senders (FasterMoE's B_w, per expert)."""
        return self.recv_counts.sum(0).tolist()
