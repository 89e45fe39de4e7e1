"""Where the bytes go: the theory (``formulas``) and, alongside it, what is measured."""

from .activations import activations_by_module, pass_costs
from .context_formulas import cp_activation_terms, ring_bytes_per_layer, ulysses_bytes_per_layer
from .formulas import (
    COLLECTIVES,
    FSDP_SHARDING,
    STRATEGIES,
    ZERO_STAGES,
    activation_bytes,
    activation_terms,
    alpha_beta_time,
    bytes_on_wire,
    communication_per_step,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    flat_padding,
    fsdp_cross_host_traffic,
    fsdp_peak_params,
    model_states,
    model_states_breakdown,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)
from .ledger import ActivationMeter, ledger, memory_groups, record_memory
from .tensor_formulas import (
    gpt_parameter_split,
    tp_activation_bytes,
    tp_activation_terms,
    tp_bytes_per_layer,
    tp_bytes_per_step,
    tp_collectives,
    tp_model_states,
)
