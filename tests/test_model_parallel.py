"""Model parallelism completed, at world 4: tp = 4 and pp = 4 train as one process, and what Megatron-LM does beyond
the basics, each against a one-process reference, a formula or a measurement.

One launch of 4 ranks runs every case (`layouts`); the one-process references run here, in the test's process.
Parity tolerances are tests/test_tensor_parallel.py's and tests/test_pipeline.py's (fp32, derived there): a layout
changes only the order of sums, so the loss moves by at most 1e-4 and a parameter after two SGD steps by 1e-5.

- tp = 4 (a vocabulary of 66 padded to 68, and with sequence parallelism), pp = 4 (1F1B; interleaved with m = 6,
  no multiple of 4), pp 2 x tp 2 (each tp rank sending 1/2 of every activation), FSDP over dp 2 x pp 2 keeping its
  units gathered across micro-batches, and tp = 4 with hidden dropout: losses and final parameters as one process.
- Bytes: the embedding under sequence parallelism sends half an all-reduce's bytes forward; a pipeline rank under
  tp sends 1/t of each activation and gradient; FSDP under pp gathers once per step instead of twice per
  micro-batch. Memory: the loss's backward allocates no (N, V/t) buffer (MemTracker); FSDP's kept units are in the
  ledger exactly. Random numbers: the tensor-parallel stream differs across tp ranks and agrees across dp ones.
"""

from __future__ import annotations

import functools

import model_parallel_checks as checks
import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import _same

import toolkit
from toolkit.train import TrainConfig, train

LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5
BASE = dict(steps=2, global_batch_size=8, optimizer="sgd", lr=0.1, progress=False, sample_memory=False)
HEADS4 = {"n_head": 4}

# (name, TrainConfig fields of the layout, the one-process reference's fields)
CASES = [
    (
        "tp 4, vocabulary 66 padded to 68",
        dict(vocab_size=66, model=HEADS4, options={"tp": 4}),
        dict(vocab_size=66, model=HEADS4),
    ),
    ("tp 4 + sp", dict(model=HEADS4, options={"tp": 4, "sequence_parallel": True}), dict(model=HEADS4)),
    (
        "tp 4 + sp, comm overlapped",
        dict(model=HEADS4, options={"tp": 4, "sequence_parallel": True, "tp_comm_overlap": True}),
        dict(model=HEADS4),
    ),
    (
        "tp 4, hidden dropout",
        dict(model=dict(HEADS4, dropout=0.1), options={"tp": 4}),
        dict(model=dict(HEADS4, dropout=0.1)),
    ),
    ("pp 4, 1f1b", dict(model={"n_layer": 4}, options={"pp": 4, "microbatches": 4}), dict(model={"n_layer": 4})),
    (
        "pp 4, interleaved, m = 6",
        dict(
            model={"n_layer": 8},
            global_batch_size=12,
            options={"pp": 4, "microbatches": 6, "schedule": "interleaved", "virtual_stages": 2},
        ),
        dict(model={"n_layer": 8}, global_batch_size=12),
    ),
    (
        "pp 2 x tp 2, sends scattered",
        dict(model=dict(HEADS4, n_layer=4), options={"pp": 2, "tp": 2, "microbatches": 4}),
        dict(model=dict(HEADS4, n_layer=4)),
    ),
    (
        "pp 2 x tp 2 + sp, comm overlapped",
        dict(
            model=dict(HEADS4, n_layer=4),
            options={"pp": 2, "tp": 2, "sequence_parallel": True, "tp_comm_overlap": True, "microbatches": 4},
        ),
        dict(model=dict(HEADS4, n_layer=4)),
    ),
    (
        "fsdp x pp 2, units kept gathered",
        dict(
            strategy="fsdp",
            model={"n_layer": 4},
            global_batch_size=16,
            options={"pp": 2, "microbatches": 4, "reshard_after_forward": False},
        ),
        dict(model={"n_layer": 4}, global_batch_size=16),
    ),
]
# dropout under activation checkpointing, at dp 2 x tp 2 + sp: the recomputation must draw the forward's masks
DROPOUT = dict(HEADS4, dropout=0.1, attention_dropout=0.1)
CHECKPOINTED = dict(strategy="ddp", model=DROPOUT, options={"tp": 2, "sequence_parallel": True})


def losses_of(run) -> list:
    return [m["value"] for m in run.metrics if m["name"] == "loss"]


def layouts(directory):
    found = {
        "embedding bytes": checks.embedding_bytes(),
        "loss backward": checks.cross_entropy_backward_memory(),
        "rng": checks.rng_streams(),
        "dropout masks": checks.dropout_masks(),
        "padded vocabulary": checks.padded_vocabulary(directory),
        "pipeline sends": checks.pipeline_sends(),
        "fsdp kept": checks.fsdp_kept_gathered(),
        "tp rings": checks.tp_ring_traffic(),
    }
    for name, fields, _ in CASES:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, **fields}), return_state=True)
        found[name] = (losses_of(run), state)
    for checkpointing, overlap in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        options = dict(CHECKPOINTED["options"], activation_checkpointing=checkpointing, tp_comm_overlap=overlap)
        run, state = train(TrainConfig(**{**BASE, **CHECKPOINTED, "options": options}), return_state=True)
        found[f"dropout, checkpointing {checkpointing}" + (", comm overlapped" if overlap else "")] = (
            losses_of(run),
            state,
        )
    everyone = [None] * dist.get_world_size()
    mine = {
        k: found[k]
        for k in ("embedding bytes", "loss backward", "rng", "dropout masks", "pipeline sends", "fsdp kept", "tp rings")
    }
    mine["padding"] = (found["padded vocabulary"]["padding zero"], found["padded vocabulary"]["moments zero"])
    dist.all_gather_object(everyone, mine)
    found["every rank"] = everyone
    return found if dist.get_rank() == 0 else None


@functools.cache
def launched(directory: str):
    return toolkit.launch(layouts, 4, args=(directory,), timeout_s=500, quiet=True)[0]


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    return launched(str(tmp_path_factory.mktemp("model-parallel")))


def compare(name, got, expected, loss_atol=LOSS_ATOL, param_atol=PARAM_ATOL):
    (losses, state), (ref_losses, ref_state) = got, expected
    assert set(state) == set(ref_state), (name, set(state) ^ set(ref_state))
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in ref_state.items()}, name
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= loss_atol, (name, losses, ref_losses)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= param_atol, (name, worst)


@pytest.mark.timeout(600)
def test_tp_4_and_pp_4_and_their_completions_train_as_one_process(got, no_leftover_ranks):
    for name, _, reference in CASES:
        run, state = train(TrainConfig(**{**BASE, "strategy": "local", **reference}), return_state=True)
        compare(name, got[name], (losses_of(run), state))


@pytest.mark.timeout(600)
def test_dropout_under_activation_checkpointing_replays_both_streams(got, no_leftover_ranks):
    """The recomputed forward draws the attention's masks (tensor-parallel stream) and the sequence-split residual
    masks as the forward did: the same step as without checkpointing. (Without the tracker's states replayed the
    parameters differ by about 1e-3.)"""
    compare("checkpointing", got["dropout, checkpointing True"], got["dropout, checkpointing False"], 0.0, 1e-7)
    overlapped = got["dropout, checkpointing True, comm overlapped"]  # tp_comm_overlap's rings recomputed too
    compare("checkpointing, overlapped", overlapped, got["dropout, checkpointing False"], LOSS_ATOL, PARAM_ATOL)
    without = train(TrainConfig(**{**BASE, "model": HEADS4, "strategy": "local"}))
    assert abs(losses_of(without)[0] - got["dropout, checkpointing False"][0][0]) > LOSS_ATOL  # the dropout dropped


@pytest.mark.timeout(600)
def test_the_embedding_reduce_scatters_under_sequence_parallelism(got, no_leftover_ranks):
    """At tp 4, b 8, s 32, h 32, fp32: the lookup's all-reduce sends 2(t-1)/t·bsh·4 bytes, its reduce-scatter
    (t-1)/t·bsh·4, half; backward all-gathers the activation's gradient and the positions' (t-1)/t·sh·4."""
    t, act, positions = 4, 8 * 32 * 32 * 4, 32 * 32 * 4
    for rank in got["every rank"]:
        plain, split = rank["embedding bytes"][False], rank["embedding bytes"][True]
        assert plain == (2 * (t - 1) / t * act, 0)
        assert split == ((t - 1) / t * act, (t - 1) / t * (act + positions))
        assert split[0] == plain[0] / 2


@pytest.mark.timeout(600)
def test_tp_comm_overlap_moves_the_same_bytes_around_a_ring(got, no_leftover_ranks):
    """At tp 4 + sp, one forward and backward of the tiny GPT (2 blocks; b 8, s 32, h 32, fp32): with tp_comm_overlap
    every column layer's all-gather and every row layer's reduce-scatter, and the row layer's all-gather in backward,
    are t - 1 = 3 passes of a chunk to the next rank (and its receive from the previous), sending what the collective
    sends, (t-1)/t of the sequence; the column layer's backward keeps its all-gather and reduce-scatter, started
    beside the GEMM that does not need them; the embedding's reduce-scatter stays (nothing to hide it behind)."""
    columns, rows = 2 * 2 + 1, 2 * 2  # qkv and fc per block, the head; proj and the MLP's proj per block
    for rank in got["every rank"]:
        (blocking, plain), (ringed, passes) = rank["tp rings"][False], rank["tp rings"][True]
        assert ringed == blocking > 0
        assert plain == {
            ("all_gather", "sequence all-gather"): columns,
            ("all_gather", "sequence all-gather again"): columns,
            ("reduce_scatter", "sequence all-gather backward"): columns,
            ("reduce_scatter", "sequence reduce-scatter"): rows + 1,
            ("all_gather", "sequence reduce-scatter backward"): rows + 1,
        }
        ring = {"column ring": columns, "row ring": rows, "row ring backward": rows}
        assert passes == {
            **{(op, label): 3 * n for label, n in ring.items() for op in ("send", "recv")},
            ("all_gather", "column backward all-gather (input again)"): columns,
            ("reduce_scatter", "column backward reduce-scatter"): columns,
            ("reduce_scatter", "sequence reduce-scatter"): 1,
            ("all_gather", "sequence reduce-scatter backward"): 1,
        }


@pytest.mark.timeout(600)
def test_the_loss_backward_turns_the_saved_softmax_into_the_gradient(got, no_leftover_ranks):
    """MemTracker: backward allocates the head's matmul gradients (256 x 8 and 512 x 8 fp32 = 24 kB) and a few
    token-sized vectors, well under one (256, 512) fp32 buffer (524 kB); cloning the softmax and multiplying
    out of place allocated two (1.05 MB)."""
    for rank in got["every rank"]:
        allocated, buffer = rank["loss backward"]
        assert allocated < buffer / 10, (allocated, buffer)


@pytest.mark.timeout(600)
def test_the_tensor_parallel_stream_differs_across_tp_ranks_and_agrees_across_dp(got, no_leftover_ranks):
    draws = {
        coordinate: (inside, outside, unchanged)
        for coordinate, inside, outside, unchanged in (rank["rng"] for rank in got["every rank"])
    }
    assert sorted(draws) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (dp, tp), (inside, outside, unchanged) in draws.items():
        assert unchanged  # a draw inside the fork leaves the default stream where it was
        assert inside == draws[(1 - dp, tp)][0] and inside != draws[(dp, 1 - tp)][0]
        assert outside == draws[(0, 0)][1] != inside  # the default stream: alike everywhere
    masks = [rank["dropout masks"] for rank in got["every rank"]]
    assert all(torch.equal(m[False], masks[0][False]) for m in masks)  # replicated activation: one mask
    split = [m[True] for m in masks]  # this rank's s/4 positions: its own mask
    assert all(not torch.equal(split[i], split[j]) for i in range(4) for j in range(i))
    assert 0.4 < torch.cat([m.float().flatten() for m in split]).mean().item() < 0.6  # p = 0.5 kept


@pytest.mark.timeout(600)
def test_a_padded_vocabulary_never_learns_its_padding_and_is_cut_away_on_join(got, no_leftover_ranks):
    """V = 66 at tp 4: pieces of 17 rows, the last rank's two last rows padding. After two AdamW steps those rows
    and their two moments are still zero (no token reaches them, the loss leaves their logits out); the full
    state has 66 rows; the checkpoint loads at tp 1 and tp 2 (no padding) bit for bit, and saves the same file."""
    found = got["padded vocabulary"]
    assert found["piece rows"] == 17 and found["full shape"] == (66, 32)
    padding = [rank["padding"] for rank in got["every rank"]]
    assert padding[3] == (True, True) and padding[:3] == [(False, False)] * 3  # ranks 0-2 hold no padding
    for layout in ("loaded at tp 1", "loaded at tp 2"):
        equal, again = found[layout]
        assert equal, layout
        assert _same(torch.load(again, weights_only=True), torch.load(found["file"], weights_only=True)), layout


@pytest.mark.timeout(600)
def test_pipeline_sends_under_tp_are_one_tth_each_and_gathered_in_the_node(got, no_leftover_ranks):
    """pp 2 x tp 2, m 4, b 8, s 32, d 32, fp32: a stage's activation is 2·32·32·4 = 8 kB per micro-batch; each tp
    rank sends half of it (4 x 4 kB), its peer all-gathers the halves ((t-1)/t of 8 kB each); the tied embedding's
    piece (V/t·d·4 = 4 kB) goes as it is. Today's bytes (each rank sending the whole) were twice these."""
    activation, tied = 2 * 32 * 32 * 4, 64 // 2 * 32 * 4
    for pp, sends, gathers in (rank["pipeline sends"] for rank in got["every rank"]):
        kind = ("activation", "tied weight") if pp == 0 else ("gradient", "tied gradient")
        assert sends == {kind[0]: 4 * activation // 2, kind[1]: tied}, (pp, sends)
        assert gathers == 4 * activation // 2, (pp, gathers)


@pytest.mark.timeout(600)
def test_fsdp_under_pp_keeps_its_units_gathered_for_one_gather_per_step(got, no_leftover_ranks):
    """Per step and stage, in units of a stage's padded Ψ: FSDP gathers 2m times (each micro-batch's forward and
    backward) and reduce-scatters once; with its units kept gathered it gathers once. Memory, from the ledger
    after each action: the units' full fp32 buffers (Σ padded numel · 4 B) on top of the fp32 shards, from the first
    forward to the last backward, against the shards alone after every action otherwise."""
    m = 4
    for rank in got["every rank"]:
        per_micro, kept = rank["fsdp kept"][False], rank["fsdp kept"][True]
        units = kept[3]
        gather_once = sum(padded * 4 // 2 for padded, _ in units)  # (N-1)/N of each unit, N = 2
        assert per_micro[0] == 2 * m * gather_once and kept[0] == gather_once
        assert per_micro[1] == kept[1] == gather_once  # one reduce-scatter per step either way
        shards, whole = sum(shard * 4 for _, shard in units), sum(padded * 4 for padded, _ in units)
        base = per_micro[2][0]  # the fp32 shards (and, on the last stage, its copy of the tied embedding: 64 x 32)
        assert base - shards in (0, 64 * 32 * 4)
        assert set(per_micro[2]) == {base}  # between actions nothing stays gathered...
        assert set(kept[2][:-1]) == {base + whole} and kept[2][-1] == base  # ...or all of it, until the last B
