"""`python -m toolkit simulate`: help with defaults, hsdp, checkpointing and prefetching, the verdict, the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from toolkit.sim import cli
from toolkit.units import seconds_text


def test_the_top_level_help_lists_every_command_and_simulate_says_its_options_and_defaults():
    top = subprocess.run(
        [sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for command in ("demo", "compare", "simulate", "grade", "release"):
        assert f"\n  {command} " in top, top
    text = cli.parser().format_help()
    for flag in (
        "--activation-checkpointing",
        "--forward-prefetch",
        "--no-backward-prefetch",
        "hsdp",
        "--tp",
        "--sequence-parallel",
        "(default: 512)",
        "(default: dgx-a100)",
        "(default: gpt3-175b)",
        "simulates (default: 0)",
    ):
        assert flag in text, flag
    documented = [a for a in cli.parser()._actions if a.dest != "help"]
    assert all(a.help for a in documented), [a.dest for a in documented if not a.help]


def test_the_fsdp_papers_configuration_is_the_readmes(capsys):
    """README: simulate(presets.gpt3_175b, "fsdp", 512, mixed_precision=True, activation_checkpointing=True,
    forward_prefetch=True, cluster="dgx-a100"): the command line gives the same call."""
    parse = cli.parser()
    args = parse.parse_args(
        "--model gpt3-175b --strategy fsdp --world-size 512 --activation-checkpointing --forward-prefetch".split()
    )
    assert cli.options_of(args, parse) == (
        "fsdp",
        dict(mixed_precision=True, activation_checkpointing=True, forward_prefetch=True),
    )
    assert args.cluster == "dgx-a100"
    args = parse.parse_args("--strategy hsdp --ranks-per-node 4 --no-backward-prefetch --fp32".split())
    assert cli.options_of(args, parse) == ("fsdp", dict(sharding_group_size=4, backward_prefetch=False))
    args = parse.parse_args("--strategy zero2 --activation-checkpointing".split())  # every strategy checkpoints
    assert cli.options_of(args, parse) == ("zero2", dict(mixed_precision=True, activation_checkpointing=True))
    assert cli.file_name(args, parse) == "sim-gpt3-175b-zero2-512-activation-checkpointing"
    args = parse.parse_args("--activation-checkpointing 2 --tp 2".split())  # every second block, before a flag
    assert cli.options_of(args, parse) == ("fsdp", dict(mixed_precision=True, activation_checkpointing=2, tp=2))
    assert cli.file_name(args, parse) == "sim-gpt3-175b-fsdp-512-tp2-activation-checkpointing2"
    assert cli.in_flags("activation_checkpointing=2", parse) == "--activation-checkpointing 2"
    for wrong in ("0", "half"):
        with pytest.raises(SystemExit) as stop:
            parse.parse_args(["--activation-checkpointing", wrong])
        assert stop.value.code == 2
    said = (
        "--activation-checkpointing: must be a whole number of 1 or more (every k-th block), op (by operation) or "
        "attention (the core attention)"
    )
    assert said + ", got 'half'" in capsys.readouterr().err
    args = parse.parse_args("--activation-checkpointing op".split())  # every block, by operation
    assert cli.options_of(args, parse)[1]["activation_checkpointing"] == "op"
    assert cli.file_name(args, parse) == "sim-gpt3-175b-fsdp-512-activation-checkpointing-op"
    args = parse.parse_args("--activation-checkpointing attention --tp 8 --sequence-parallel".split())  # Megatron's
    assert cli.options_of(args, parse)[1]["activation_checkpointing"] == "attention"
    assert (
        cli.file_name(args, parse) == "sim-gpt3-175b-fsdp-512-tp8-sequence-parallel-activation-checkpointing-attention"
    )
    assert cli.in_flags('activation_checkpointing="attention"', parse) == "--activation-checkpointing attention"
    with pytest.raises(SystemExit) as stop:
        bad = parse.parse_args("--strategy ddp --forward-prefetch".split())
        cli.options_of(bad, parse)
    assert stop.value.code == 2
    # activation checkpointing is every strategy's option; --tp makes the strategy the method over dp = world / tp
    args = parse.parse_args("--strategy zero1 --activation-checkpointing --tp 8 --sequence-parallel".split())
    assert cli.options_of(args, parse) == (
        "zero1",
        dict(mixed_precision=True, activation_checkpointing=True, tp=8, sequence_parallel=True),
    )
    args = parse.parse_args("--tp 8 --sequence-parallel --tp-comm-overlap".split())
    assert cli.options_of(args, parse)[1] == dict(
        mixed_precision=True, tp=8, sequence_parallel=True, tp_comm_overlap=True
    )
    args = parse.parse_args("--tp 8 --tp-comm-overlap backward".split())  # Megatron-LM's: the backward's alone
    assert cli.options_of(args, parse)[1] == dict(mixed_precision=True, tp=8, tp_comm_overlap="backward")
    assert cli.file_name(args, parse) == "sim-gpt3-175b-fsdp-512-tp8-tp-comm-overlap-backward"
    with pytest.raises(SystemExit):
        parse.parse_args("--tp 8 --tp-comm-overlap forward".split())


def test_a_job_that_fits_gets_its_time_report_and_trace_and_one_that_does_not_gets_what_would_make_it_fit(
    tmp_path, capsys
):
    assert (
        cli.main(
            [
                "--model",
                "tiny",
                "--strategy",
                "hsdp",
                "--world-size",
                "16",
                "--activation-checkpointing",
                "--forward-prefetch",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fits in the A100 SXM 80GB's" in out and "FLOP/s per GPU" in out
    assert not re.search(r"(?<![\d.])0\.0+(?![\d])", out), "a number printed as zero"
    report = (tmp_path / "sim-tiny-hsdp-16-activation-checkpointing-forward-prefetch-report.html").read_text()
    assert "Memory at the peak" in report and "fits in the" in report and "modelled: rank 0 of 16" in report
    assert (tmp_path / "sim-tiny-hsdp-16-activation-checkpointing-forward-prefetch-trace.json").exists()

    assert cli.main(["--model", "gpt3-175b", "--layers", "2", "--strategy", "ddp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "shard the model states" in out and "TFLOP/s" not in out
    assert not list(tmp_path.glob("sim-gpt3-175b-ddp-512-*trace.json"))
    assert "DOES NOT FIT" in (tmp_path / "sim-gpt3-175b-ddp-512-layers2-report.html").read_text()


def test_moe_with_more_gpus_than_experts_and_a_tensor_parallel_layout_simulate_from_the_command_line(tmp_path, capsys):
    """The trial: the CLI crashed for MoE-GPT-S (16 experts) at 32 GPUs and more (index_add on meta). And
    `--tp` gives simulate's tp option: the strategy is the data-parallel method over world / tp replicas."""
    assert (
        cli.main(
            ["--model", "moe-gpt-s", "--layers", "1", "--strategy", "ddp", "--world-size", "32", "--out", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ddp on 32 simulated ranks" in out and "all_to_all" in out and "fits in the" in out
    assert (
        cli.main(
            [
                "--model",
                "tiny",
                "--strategy",
                "zero1",
                "--world-size",
                "8",
                "--tp",
                "2",
                "--sequence-parallel",
                "--activation-checkpointing",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "zero1 over dp=4 x tp=2 with sequence parallelism on 8 simulated ranks" in out
    assert cli.main(["--model", "tiny", "--tp", "2", "--tp-comm-overlap", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--tp-comm-overlap hides" in err and "needs --sequence-parallel with tp > 1 (e.g. --tp 2)" in err, err
    assert cli.main(["--model", "tiny", "--sequence-parallel", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # said in flags: the error came from Python's keywords
    assert "--sequence-parallel splits" in err and "(e.g. --tp 2)" in err and "=" not in err, err


def _summary_numbers(sim) -> tuple:
    return (
        sim.memory,
        sim.peak,
        sim.peak_memory,
        sim.bytes_per_step,
        sim.cross_node_bytes,
        sim.flops,
        round(sim.step_time, 12),
    )


def test_simulate_with_a_pipeline_on_the_command_line_is_the_python_call(tmp_path, capsys, monkeypatch):
    """`simulate --pp 2 --microbatches 4 --schedule interleaved --virtual-stages 2` gives exactly what
    simulate(..., pp=2, microbatches=4, schedule="interleaved", virtual_stages=2) does."""
    from toolkit.models import presets
    from toolkit.sim import simulate

    calls = []
    real = simulate

    def recorded(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]

    monkeypatch.setattr("toolkit.sim.simulate", recorded)
    argv = [
        "--model",
        "tiny",
        "--layers",
        "4",
        "--strategy",
        "zero1",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--batch-per-rank",
        "4",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    python = real(
        lambda: presets.tiny_gpt(n_layer=4),
        "zero1",
        16,
        batch_per_rank=4,
        cluster="dgx-a100",
        mixed_precision=True,
        tp=2,
        pp=2,
        microbatches=4,
        schedule="interleaved",
        virtual_stages=2,
        progress=False,
    )
    assert _summary_numbers(calls[0]) == _summary_numbers(python)
    assert "bubble" in out and "sent per rank per step" in out
    name = "sim-tiny-zero1-16-layers4-batch-per-rank4-tp2-pp2-microbatches4-schedule-interleaved-virtual-stages2"
    assert (tmp_path / f"{name}-report.html").exists() and (tmp_path / f"{name}-trace.json").exists()


def test_an_moe_model_under_a_pipeline_context_and_expert_parallelism_is_the_python_call(tmp_path, capsys, monkeypatch):
    """The trial: `simulate --model moe-gpt-s --pp 2` stopped with an error telling to build the model over
    `stage_group(...)`, which no flag could do. The command line builds an MoE preset over its expert group, carved
    by --ep (default: the stage) from the --pp, --cp and --tp given, as moe_model_fn does for train."""
    from toolkit.models import presets
    from toolkit.parallel.mesh import expert_group
    from toolkit.sim import simulate

    calls = []
    real = simulate
    monkeypatch.setattr("toolkit.sim.simulate", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    layout = dict(pp=2, cp=2)
    argv = "--model moe-gpt-s --layers 2 --strategy ddp --world-size 16 --pp 2 --cp 2 --batch-per-rank 2".split()
    for ep in (None, 2):
        assert cli.main([*argv, *(["--ep", str(ep)] if ep else []), "--out", str(tmp_path)]) == 0
        python = real(
            lambda ep=ep: presets.moe_gpt_s(n_layer=2, group=expert_group(ep or 8, **layout)),
            "ddp",
            16,
            batch_per_rank=2,
            cluster="dgx-a100",
            mixed_precision=True,
            microbatches=2,
            schedule="1f1b",
            progress=False,
            **layout,
            **({"ep": ep} if ep else {}),
        )
        assert _summary_numbers(calls[-1]) == _summary_numbers(python)
    by_ep = [c.memory["params"] for c in calls]
    assert by_ep[1] > by_ep[0]  # experts over 2 ranks instead of the stage's 8: each rank holds 4x the experts
    assert "all_to_all" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--model", "tiny", "--ep", "2", "--out", str(tmp_path)])
    assert "--ep splits the experts of an MoE model: --model tiny has none" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, wrong",
    [
        ("--model tiny --world-size 12 --tp 3", "--tp 3"),
        ("--model tiny --world-size 12 --tp 4", "--tp 4"),
        ("--model tiny --world-size 12 --tp 2 --pp 3", "--pp 3"),
        ("--model gpt3-175b --layers 4 --world-size 512 --tp 64", "--tp 64"),
        ("--model gpt3-175b --layers 4 --world-size 512 --tp 7", "--tp 7"),
        ("--model tiny --world-size 12 --cp 3", "--cp 3"),
        ("--model tiny --world-size 16 --cp 2 --tp 16", "--tp 16"),
        ("--model moe-gpt-s --layers 2 --world-size 16 --pp 2 --ep 3", "--ep 3"),
    ],
)
def test_a_layout_that_does_not_fit_is_answered_with_values_that_fit_every_constraint_at_once(flags, wrong, capsys):
    """The trial: --tp 7 suggested divisors of the world that then failed the head count, and --tp 64's error
    listed divisors of the heads that ignored the world. Every value suggested passes every check (the
    tensor-parallel code's own, the world's, the pipeline's), and every value left out fails one."""
    argv = [*flags.split(), "--batch-per-rank", "6"]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {wrong} does not fit" in err and "Choose a tp" not in err and "tp=" not in err, err
    values = [int(v) for v in err.split("Values that fit every constraint: [")[1].split("]")[0].split(", ")]
    flag, world = wrong.split()[0], int(flags.split("--world-size ")[1].split()[0])
    assert values and int(wrong.split()[1]) not in values
    parse = cli.parser()

    def fits(value) -> bool:
        args = parse.parse_args([*argv, flag, str(value)])
        build = cli.PRESETS[args.model]
        try:
            cli.check_layout(args, lambda: build(n_layer=args.layers) if args.layers else build(), parse)
        except SystemExit:
            return False
        return True

    assert [v for v in range(1 + (flag in ("--pp", "--cp")), world + 1) if world % v == 0 and fits(v)] == values
    capsys.readouterr()


SMALL = {
    "name": "small",
    "gpu": {
        "name": "small-gpu",
        "peak_flops": {"bf16": 1e14, "fp32": 2e13},
        "memory_bytes": 150_000,
        "memory_bandwidth": 1e12,
    },
    "gpus_per_node": 4,
    "intra": ["100 GB/s", "2 us"],
    "inter": ["100 Gb/s", "8 us"],
}


def test_advice_is_said_in_flags_with_a_real_value_and_the_verdict_once(tmp_path, capsys):
    """Not "activation checkpointing (activation_checkpointing=True)" nor "shorter sequences (seq_len=2048" (the
    current length, as if it were the suggestion): the flag, and a value that would help. The tiny GPT on a
    cluster of your own (a JSON file) whose GPUs hold 150 kB."""
    (tmp_path / "small.json").write_text(json.dumps(SMALL))
    common = [
        "--model",
        "tiny",
        "--strategy",
        "zero3",
        "--world-size",
        "4",
        "--cluster",
        str(tmp_path / "small.json"),
        "--out",
        str(tmp_path),
    ]
    assert cli.main(common) == 0
    out = capsys.readouterr().out
    assert out.count("DOES NOT FIT") == 1 and "fits in" not in out, out
    assert "--activation-checkpointing" in out and "activation_checkpointing" not in out, out
    shorter = out.split("shorter sequences (--seq-len ")[1]
    suggested = int(shorter.split(" or less")[0])
    assert suggested < 32 and suggested & (suggested - 1) == 0 and "now 32;" in shorter, out
    assert cli.main([*common, "--batch-per-rank", "4", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert out.count("DOES NOT FIT") == 1 and "_" not in out.split("To fit:")[1].split("sent per rank")[0], out
    smaller = re.search(r"\(--accumulation (\d+), (\d+) sequences? a pass, now 4\b", out)
    assert smaller and int(smaller.group(2)) < 4 and int(smaller.group(1)) * int(smaller.group(2)) == 4, out
    # two configurations, two sets of files: the second did not overwrite the first
    assert len(list(tmp_path.glob("sim-tiny-zero3-4-*-report.html"))) == 2


def test_a_cluster_of_your_own_from_a_json_file_prices_as_the_python_dict(tmp_path, capsys):
    from toolkit.sim import simulate

    mine = dict(SMALL, gpu=dict(SMALL["gpu"], memory_bytes=80e9))
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    assert (
        cli.main(
            [
                "--model",
                "tiny",
                "--strategy",
                "fsdp",
                "--world-size",
                "8",
                "--cluster",
                str(tmp_path / "mine.json"),
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    python = simulate(
        cli.PRESETS["tiny"],
        "fsdp",
        8,
        mixed_precision=True,
        progress=False,
        cluster=dict(mine, intra=tuple(mine["intra"]), inter=tuple(mine["inter"])),
    )
    assert f"small, bf16, per-operation model: step {seconds_text(python.step_time)}" in out, out
    assert out.count("fits in the small-gpu's") == 1
    assert (tmp_path / "sim-tiny-fsdp-8-cluster-mine-report.html").exists()
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    assert cli.main(["--model", "tiny", "--cluster", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2
    assert "is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--model", "tiny", "--cluster", str(tmp_path / "none.json")])
    assert "could not read a cluster" in capsys.readouterr().err
