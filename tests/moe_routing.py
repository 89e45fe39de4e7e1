"""Skewed routing for the MoE tests: a router that ranks the experts alike for every token."""

import torch


def prefer(router_weight: torch.Tensor, first: int, second: int) -> None:
    """Logits depend on feature 0 only (the tests set it to 1): every token ranks expert ``first`` top,
    ``second`` next, then the rest by id. The same two experts get every row: the straggler case."""
    E = router_weight.shape[0]
    with torch.no_grad():
        scores = -0.1 * torch.arange(1, E + 1, dtype=torch.float32)
        scores[first], scores[second] = 2.0, 1.0
        router_weight.zero_()
        router_weight[:, 0] = scores
