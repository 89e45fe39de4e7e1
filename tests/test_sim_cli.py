"""`python -m toolkit simulate`: help with defaults, hsdp, checkpointing and prefetching, the verdict, the report."""
from __future__ import annotations

import subprocess
import sys

import pytest

from toolkit.sim import cli


def test_the_top_level_help_lists_every_command_and_simulate_says_its_options_and_defaults():
    top = subprocess.run([sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, timeout=120).stdout
    for command in ("demo", "compare", "simulate", "grade", "release"):
        assert f"\n  {command} " in top, top
    text = cli.parser().format_help()
    for flag in ("--activation-checkpointing", "--forward-prefetch", "--no-backward-prefetch", "hsdp", "--tp",
                 "--sequence-parallel", "(default: 512)", "(default: dgx-a100)", "(default: gpt3-175b)",
                 "simulates (default: 0)"):
        assert flag in text, flag
    documented = [a for a in cli.parser()._actions if a.dest != "help"]
    assert all(a.help for a in documented), [a.dest for a in documented if not a.help]


def test_the_fsdp_papers_configuration_is_the_readmes():
    """README: simulate(presets.gpt3_175b, "fsdp", 512, mixed_precision=True, activation_checkpointing=True,
    forward_prefetch=True, cluster="dgx-a100"): the command line gives the same call."""
    parse = cli.parser()
    args = parse.parse_args("--model gpt3-175b --strategy fsdp --world-size 512 --activation-checkpointing "
                            "--forward-prefetch".split())
    assert cli.options_of(args, parse) == ("fsdp", dict(mixed_precision=True, activation_checkpointing=True,
                                                        forward_prefetch=True))
    assert args.cluster == "dgx-a100"
    args = parse.parse_args("--strategy hsdp --ranks-per-node 4 --no-backward-prefetch --fp32".split())
    assert cli.options_of(args, parse) == ("fsdp", dict(sharding_group_size=4, backward_prefetch=False))
    args = parse.parse_args("--strategy zero2 --activation-checkpointing".split())  # every strategy checkpoints
    assert cli.options_of(args, parse) == ("zero2", dict(mixed_precision=True, activation_checkpointing=True))
    with pytest.raises(SystemExit) as stop:
        bad = parse.parse_args("--strategy ddp --forward-prefetch".split())
        cli.options_of(bad, parse)
    assert stop.value.code == 2
    # activation checkpointing is every strategy's option; --tp makes the strategy the method over dp = world / tp
    args = parse.parse_args("--strategy zero1 --activation-checkpointing --tp 8 --sequence-parallel".split())
    assert cli.options_of(args, parse) == ("zero1", dict(mixed_precision=True, activation_checkpointing=True, tp=8,
                                                         sequence_parallel=True))


def test_a_job_that_fits_gets_its_time_report_and_trace_and_one_that_does_not_gets_what_would_make_it_fit(
        tmp_path, capsys):
    assert cli.main(["--model", "tiny", "--strategy", "hsdp", "--world-size", "16", "--activation-checkpointing",
                     "--forward-prefetch", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fits in the A100 SXM 80GB's" in out and "FLOP/s per GPU" in out and "0.000" not in out
    report = (tmp_path / "sim-tiny-hsdp-16-report.html").read_text()
    assert "Memory at the peak" in report and "fits in the" in report and "modelled: rank 0 of 16" in report
    assert (tmp_path / "sim-tiny-hsdp-16-dgx-a100-trace.json").exists()

    assert cli.main(["--model", "gpt3-175b", "--layers", "2", "--strategy", "ddp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "shard the model states" in out and "TFLOP/s" not in out
    assert not (tmp_path / "sim-gpt3-175b-ddp-512-dgx-a100-trace.json").exists()
    assert "DOES NOT FIT" in (tmp_path / "sim-gpt3-175b-ddp-512-report.html").read_text()


def test_moe_with_more_gpus_than_experts_and_a_tensor_parallel_layout_simulate_from_the_command_line(tmp_path, capsys):
    """The trial: the CLI crashed for MoE-GPT-S (16 experts) at 32 GPUs and more (index_add on meta). And
    `--tp` gives simulate's tp option: the strategy is the data-parallel method over world / tp replicas."""
    assert cli.main(["--model", "moe-gpt-s", "--layers", "1", "--strategy", "ddp", "--world-size", "32",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ddp on 32 simulated ranks" in out and "all_to_all" in out and "fits in the" in out
    assert cli.main(["--model", "tiny", "--strategy", "zero1", "--world-size", "8", "--tp", "2", "--sequence-parallel",
                     "--activation-checkpointing", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "zero1 over dp=4 x tp=2 with sequence parallelism on 8 simulated ranks" in out
    assert cli.main(["--model", "tiny", "--sequence-parallel", "--out", str(tmp_path)]) == 2
    assert "needs tp > 1" in capsys.readouterr().out
