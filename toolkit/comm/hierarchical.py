"""Tutel's 2D hierarchical all-to-all (2DH): first inside each node, then across nodes, same result.

Why: in a flat all-to-all over W ranks, in N nodes of G, every rank sends W-1 messages, W-G of them
across the network, each 1/W of its buffer. At thousands of GPUs those messages are tiny, so the
time goes to per-message latency, and a node's card carries G x (W-G) of them. 2DH moves the same
bytes across the network in fewer, larger messages. Rank (n, l) is local rank l of node n:

    1. stride     order my blocks by (destination's local rank, destination node)
    2. intra      all-to-all inside the node: local rank j gets, from every rank of its node, the
                  blocks bound for local rank j of every node            (G-1 messages, fast links)
    3. regroup    what I now hold is ordered by (source local rank, destination node): reorder it by
                  destination node
    4. inter      all-to-all among the ranks with my local index, one per node: to node m, every block
                  my node has for rank (m, l), in one message                (N-1 messages of G blocks)

What arrives in step 4 from node m is (m, 0)'s rows for me, then (m, 1)'s, ...: the flat all-to-all's
output order, so nothing is reordered at the end. Per rank: G-1 messages inside the node and N-1
across, instead of G-1 and W-G; the bytes that cross the network are the same. The first arXiv
version of the Tutel paper (arXiv 2206.03382v1, its abstract) reports 2DH up to 20.7x faster than the
previous all-to-all at 2,048 GPUs (the published version's headline is 4.96x / 5.75x for a whole MoE
layer on 16 / 2,048 A100); on few nodes the extra pass inside the node costs more than it saves
(``predicted_times`` finds the crossover on the emulated link's model).

Which to run (``choose``, the MoE layer's ``all_to_all_algorithm="auto"``): the lecture's "adaptive
all-to-all algorithm for different scales (Linear/2DH)". Tutel's released code decides by scale, once:
its launcher sets 2DH (``TUTEL_ALLTOALL_ALGO=2D``) from 64 nodes of at least 8 GPUs, linear below, and a
user may force either. Here, on an emulated link, the link's own model decides per call from the
message size every rank agrees on (the largest dispatch), as the crossover above; with no emulated
link to price, Tutel's rule of scale.

Uneven splits (an MoE layer's rows): the rank in the middle must know how many rows of each block it
forwards, so step 2 is preceded by an all-to-all of counts inside the node (N integers per peer).
Tutel does not need it: its buffers are padded to a fixed capacity. Every step goes through the door
(``toolkit.comm``), so the trace shows each all-to-all, labelled ``args["2dh"]``: "counts",
"intra-node", "inter-node".

Nodes are consecutive positions of the group: positions n*G .. n*G+G-1 form node n (the world group
on nodes of G consecutive ranks, as ``toolkit.comm.emulate(ranks_per_node=G)`` numbers them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as door

_groups: dict = {}


def node_groups(group, node_size: int):
    """(my node's group, the group of my local index across nodes), created once per (group, G). Only
    the member ranks take part in creating each (``use_local_synchronization``)."""
    ranks = door.group_ranks(group)
    key = (tuple(ranks), node_size)
    if key not in _groups:
        W, G = len(ranks), node_size
        if isinstance(G, bool) or not isinstance(G, int) or G < 1 or W % G:
            fits = [g for g in range(1, W + 1) if W % g == 0]
            raise ValueError(
                f"2DH all-to-all: node_size={node_size!r} must divide the group's {W} ranks (every "
                f"node holds the same number); choose one of {fits}."
            )
        me = ranks.index(dist.get_rank())
        node, local = divmod(me, G)
        inside = dist.new_group([ranks[node * G + j] for j in range(G)], use_local_synchronization=True)
        across = dist.new_group([ranks[m * G + local] for m in range(W // G)], use_local_synchronization=True)
        _groups[key] = (inside, across)
    return _groups[key]


def _step(output, input, out_splits, in_splits, group, name):
    handle = door.all_to_all(output, input, out_splits, in_splits, group=group, async_op=True)
    handle.event["args"]["2dh"] = name
    handle.wait()


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    node_size: int = 1,
) -> None:
    """The flat all-to-all's result (block j of my ``input`` to position j; block i of ``output`` from
    position i; split sizes in rows along dim 0, None for equal), in the four steps above."""
    ranks = door.group_ranks(group)
    W, G = len(ranks), node_size
    inside, across = node_groups(group, G)
    if G in (1, W):  # one rank per node, or one node: 2DH is the flat all-to-all
        return door.all_to_all(output, input, output_split_sizes, input_split_sizes, group=group)
    N = W // G
    even = input_split_sizes is None and output_split_sizes is None
    ins = [input.shape[0] // W] * W if input_split_sizes is None else [int(s) for s in input_split_sizes]
    outs = [output.shape[0] // W] * W if output_split_sizes is None else [int(s) for s in output_split_sizes]
    if even:  # every block has the same size: nothing to tell the rank in the middle
        held = [[ins[0]] * N for _ in range(G)]
    else:  # held[local][m]: rows local rank `local` has for (node m, my local index)
        mine = torch.tensor([[ins[m * G + j] for m in range(N)] for j in range(G)], dtype=torch.long)
        theirs = torch.empty_like(mine)
        _step(theirs.reshape(-1), mine.reshape(-1), [N] * G, [N] * G, inside, "counts")
        held = theirs.tolist()

    blocks = input.split(ins)  # 1. stride
    strided = torch.cat([blocks[m * G + j] for j in range(G) for m in range(N)])
    middle = input.new_empty((sum(map(sum, held)),) + tuple(input.shape[1:]))  # 2. intra
    _step(
        middle,
        strided,
        [sum(h) for h in held],
        [sum(ins[m * G + j] for m in range(N)) for j in range(G)],
        inside,
        "intra-node",
    )
    pieces = middle.split([held[local][m] for local in range(G) for m in range(N)])  # 3. regroup
    regrouped = torch.cat([pieces[local * N + m] for m in range(N) for local in range(G)])
    _step(
        output,
        regrouped,
        [sum(outs[m * G : (m + 1) * G]) for m in range(N)],  # 4. inter
        [sum(held[local][m] for local in range(G)) for m in range(N)],
        across,
        "inter-node",
    )


# --- the model: flat against 2DH on the emulated link -------------------------------------------------
def predicted_times(settings, nodes: int, node_size: int, bytes_per_rank: float) -> dict:
    """Seconds of one all-to-all of ``bytes_per_rank`` (even splits) issued by every rank at once, flat
    and 2DH, on the emulated link's model (``comm/cost.py``: the node's card shared by its ranks):
    {"flat", "2dh", "2dh intra", "2dh inter", "messages flat", "messages 2dh"} (messages per rank)."""
    from .cost import demand, together

    G, W = node_size, nodes * node_size
    if settings.ranks_per_node != G:
        raise ValueError(
            f"predicted_times: the link's nodes hold {settings.ranks_per_node} ranks, not node_size={G}; "
            f"make them agree (toolkit.comm.emulate(..., ranks_per_node={G}))."
        )
    block = bytes_per_rank / W

    def phase(groups, blocks_per_message):
        # even splits on equal nodes: every rank's demand is the first one's (computing it once keeps
        # thousands of ranks cheap); the node's card still carries its ranks in turn
        members = groups[0]
        size = [block * blocks_per_message] * len(members)
        one = demand(settings, "all_to_all", members, members[0], 0.0, dict(sent=size, received=size))
        return together(settings, {r: one for group in groups for r in group})

    flat = phase([list(range(W))], 1)
    intra = phase([[n * G + j for j in range(G)] for n in range(nodes)], nodes) if G > 1 else 0.0
    inter = phase([[m * G + j for m in range(nodes)] for j in range(G)], G) if nodes > 1 else 0.0
    return {
        "flat": flat,
        "2dh": intra + inter,
        "2dh intra": intra,
        "2dh inter": inter,
        "messages flat": W - 1,
        "messages 2dh": (G - 1) + (nodes - 1),
    }


TUTEL_2DH_NODES, TUTEL_2DH_NODE_SIZE = 64, 8  # tutel.launcher: 2DH from 64 hosts of at least 8 local GPUs


def choose(settings, world: int, node_size: int, bytes_per_rank: float) -> tuple[str, str]:
    """("flat" | "2dh", why) for one all-to-all of ``bytes_per_rank`` over ``world`` ranks in nodes of
    ``node_size``: the emulated link's model when one is on (its ranks_per_node must be node_size), else
    Tutel's rule of scale. Every rank must pass the same numbers to choose alike."""
    nodes = world // node_size
    if node_size in (1, world):
        return "flat", f"flat: {'one rank per node' if node_size == 1 else 'one node'}, 2DH is the flat all-to-all"
    if settings is None or settings.ranks_per_node != node_size:
        two = nodes >= TUTEL_2DH_NODES and node_size >= TUTEL_2DH_NODE_SIZE
        return ("2dh" if two else "flat"), (
            f"{'2dh' if two else 'flat'}: no emulated link of nodes of {node_size} to price, so Tutel's rule of "
            f"scale: 2DH from {TUTEL_2DH_NODES} nodes of at least {TUTEL_2DH_NODE_SIZE} ranks (here {nodes} of "
            f"{node_size})"
        )
    t = predicted_times(settings, nodes, node_size, bytes_per_rank)
    two = t["2dh"] < t["flat"]
    return ("2dh" if two else "flat"), (
        f"{'2dh' if two else 'flat'}: on the emulated link, {bytes_per_rank:,.0f} bytes per rank over {nodes} nodes "
        f"of {node_size}: flat {t['flat'] * 1e3:.3g} ms ({t['messages flat']} messages), 2DH {t['2dh'] * 1e3:.3g} ms "
        f"({t['messages 2dh']} messages)"
    )
