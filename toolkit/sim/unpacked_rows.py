"""transformers' models on meta tensors: rows that are one sequence each, as the toolkit's data always are.

Without a key-value cache (a model in training: `checkpointing.without_cache`), transformers' causal mask asks the
position ids whether several sequences are packed into a row (`masking_utils.find_packed_sequence_indices`), by
reading their values; meta tensors have none ("Tensor.item() cannot be called on meta tensors"). The toolkit's
corpora give one sequence a row, which is the answer the function returns for such data (None: no packing), so a
simulated rank is told that, and takes the path a real rank takes: the plain causal mask, the fused attention.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def unpacked_rows():
    """Inside: transformers finds no packed sequences in meta position ids (where a model has imported it: `simulate`
    enters this around its steps, once the model is built)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def on_meta_too(position_ids):
        return None if position_ids.is_meta else original(position_ids)

    masking.find_packed_sequence_indices = on_meta_too
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
