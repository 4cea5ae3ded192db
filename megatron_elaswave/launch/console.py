"""The launcher's lines on stderr, and the words they are made of."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence



def log(message: str) -> None:
    print(f"[elaswave-run] {message}", file=sys.stderr, flush=True)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def rank_list(ranks: Sequence[int]) -> str:
    return f"rank{'' if len(ranks) == 1 else 's'} {', '.join(map(str, ranks))}"
