"""The layout flags of `python -m toolkit simulate` checked against every constraint at once, before anything is
simulated: a value that breaks one is answered, in flags, with the values that keep all of them."""

from __future__ import annotations

from .flags import in_flags


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_refusal(model_fn, tp: int, sequence_parallel: bool, seq_len: int) -> str | None:
    """Why the tensor-parallel code refuses to split `model_fn()` over `tp` ranks (its own checks: heads, the
    vocabulary, every split weight), or None: the model (one block is enough, its layers are alike) is wrapped
    on meta tensors by one rank of a fake world of `tp` ranks."""
    if sequence_parallel and seq_len % tp:
        return f"--sequence-parallel cuts the {seq_len} positions of a sequence over --tp ranks"
    from .. import parallel
    from .cluster import cluster
    from .simulate import build_on_meta

    with cluster(tp, 0):
        try:
            parallel.wrap(build_on_meta(model_fn), "local", tp=tp, sequence_parallel=sequence_parallel)
        except ValueError as exc:
            return str(exc)
    return None


def _seq_len(args, model_fn) -> int:
    """--seq-len, else the model's context (a toolkit GPT's seq_len, a Hugging Face config's positions)."""
    if args.seq_len:
        return args.seq_len
    import torch

    with torch.device("meta"):
        config = getattr(model_fn(), "config", None)
    return getattr(config, "seq_len", None) or getattr(config, "max_position_embeddings", None) or 1


def check_layout(args, model_fn, parse, one_block=None) -> None:
    """--tp, --cp, --pp, --virtual-stages and --microbatches against every constraint at once, before anything is
    simulated: a replica's pp x cp x tp ranks divide the world, the sequence splits into 2 x cp chunks (ring
    attention's zigzag), the tensor-parallel code splits the model over tp
    (`tp_refusal`), the blocks cut evenly into pp x virtual-stages stages, the micro-batches divide a replica's
    batch. A value that breaks one is answered with the values that keep all of them. `one_block`: the model
    with one block, for the tensor-parallel check (default: the whole model)."""
    tp, pp, cp, v, world = args.tp, args.pp, args.cp, args.virtual_stages, args.world_size
    if tp > 1:
        seq_len = _seq_len(args, model_fn)

        def tp_fits(t: int, p: int = pp) -> str | None:
            if world % (t * p * cp):
                return (
                    f"a replica's --pp {p} x --cp {cp} x --tp {t} ranks do not divide the {world} ranks"
                    if cp > 1
                    else f"a replica's --pp {p} x --tp {t} ranks do not divide the {world} ranks"
                )
            return tp_refusal(one_block or model_fn, t, args.sequence_parallel, seq_len) if t > 1 else None

        why = tp_fits(tp)
        if why:
            fits = [t for t in _divisors(world // (pp * cp) if world % (pp * cp) == 0 else world) if not tp_fits(t)]
            why = in_flags(why, parse).split(". ")[0].rstrip(".")  # its own suggestions knew one constraint only
            parse.error(f"--tp {tp} does not fit: {why}. Values that fit every constraint: {fits}.")
    if cp > 1:
        seq_len = _seq_len(args, model_fn)

        def cp_fits(c: int) -> bool:
            return world % (tp * pp * c) == 0 and seq_len % (2 * c) == 0

        if not cp_fits(cp):
            fits = [c for c in _divisors(world) if c > 1 and cp_fits(c)]
            parse.error(
                f"--cp {cp} does not fit: a replica's --pp {pp} x --cp x --tp {tp} ranks must divide the "
                f"{world} ranks, and the sequence of {seq_len} tokens must cut into 2 x --cp chunks (ring "
                f"attention's zigzag: rank i holds chunks i and 2cp-1-i). "
                + (
                    f"Values that fit every constraint: {fits}."
                    if fits
                    else f"No value does with --tp {tp} and --pp {pp}: change those, or --seq-len."
                )
            )
    if args.ep is not None and (world // pp) % args.ep:
        stage = world // pp
        fits = _divisors(stage)
        parse.error(
            f"--ep {args.ep} does not fit: the experts' groups are carved out of a pipeline stage's "
            f"{stage} ranks (--world-size {world} / --pp {pp}), so --ep must divide {stage}. "
            f"Values that fit every constraint: {fits}."
        )
    if pp > 1:
        import torch

        from ..parallel.pipeline.split import find_blocks

        with torch.device("meta"):
            blocks = len(find_blocks(model_fn())[1])

        def pp_fits(p: int) -> bool:
            return world % (tp * cp * p) == 0 and blocks % (p * v) == 0

        if not pp_fits(pp):
            fits = [p for p in _divisors(world) if p > 1 and pp_fits(p)]
            parse.error(
                f"--pp {pp} does not fit: a replica's --pp x --cp {cp} x --tp {tp} ranks must divide the "
                f"{world} ranks, "
                f"and the model's {blocks} blocks must cut evenly into --pp x --virtual-stages {v} stages. "
                + (
                    f"Values that fit every constraint: {fits}."
                    if fits
                    else f"No value does with --tp {tp} and --virtual-stages {v}: change those, or --layers."
                )
            )
    if pp > 1:
        if args.schedule == "interleaved" and v < 2:
            parse.error("--schedule interleaved runs several stages per rank: add --virtual-stages 2 or more")
        if args.schedule != "interleaved" and v != 1:
            parse.error(
                f"--virtual-stages {v} needs --schedule interleaved (--schedule {args.schedule} runs one "
                f"stage per rank)"
            )
        m = args.microbatches or pp
        if args.batch_per_rank % m:
            parse.error(
                f"--microbatches {m}{'' if args.microbatches else ' (the default: --pp)'} does not divide "
                f"--batch-per-rank {args.batch_per_rank} (a replica's sequences per step): use --microbatches "
                f"one of {_divisors(args.batch_per_rank)}, or --batch-per-rank a multiple of {m} (e.g. "
                f"{m * max(1, -(-args.batch_per_rank // m))})."
            )
