"""Argument types the command lines share (`python -m toolkit simulate | compare | demo`): a bad value is
argparse's error, in the flag's words ("argument --world-size: must be a whole number of 1 or more, got '-2'"),
never a traceback from deeper down."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got {text!r}")
    return value
