"""argparse types shared by the command line (:mod:`flashnb.cli`) and the subcommands that parse their own
options (:mod:`flashnb.instruments.bench`, :mod:`flashnb.instruments`)."""

from __future__ import annotations

import argparse

__all__ = ["int_in"]


def int_in(lo: int, hi: int | None = None):
    """An argparse ``type``: an int in ``lo..hi`` (no upper bound when ``hi`` is None); out of range is an
    argparse error (usage line, message, exit code 2), never a traceback."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            rule = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {rule}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse
