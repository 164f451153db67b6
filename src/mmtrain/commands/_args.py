"""Argument types shared by the commands (a helper module, not a command: its name starts with _).

`count` is the type of every flag that counts things (samples, batch sizes, GPUs, steps):
people write large counts as `4e8`, `1_000_000` or `1,000,000`, and argparse's `int` refuses
all three. A count must still be a whole, non-negative number: `2.5` or `1e-3` samples is a
typo, and is refused with the flag's name rather than rounded.

`bucket_shapes` and `sample_size` read a denoiser's sample sizes as `data.buckets` writes them:
`HxW`, or `TxHxW` for a clip.

`add_ownership_arguments` and `ownership_given` are the rent-or-buy prices that
`mmtrain plan --own` and `mmtrain report` both take (plan/ownership.py).
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal

MAX_COUNT = Decimal(10**18)  # beyond every real count; stops 1e999999 from building a huge int
# 1,000,000 with commas only between groups of three digits (so "1,00" is refused, not 100).
_THOUSANDS = re.compile(r"[0-9]{1,3}(,[0-9]{3})+")
# Python's literal syntax (single underscores between digits), with an optional exponent.
_NUMBER = re.compile(r"-?[0-9]+(_[0-9]+)*(\.[0-9]*)?([eE][+-]?[0-9]+)?")


def count(text: str) -> int:
    """A non-negative whole number written as `400000000`, `4e8`, `4E+8`, `1_000_000` or
    `1,000,000`; anything else raises argparse.ArgumentTypeError (argparse adds the flag)."""
    raw = text.strip()
    plain = raw.replace(",", "") if _THOUSANDS.fullmatch(raw) else raw
    value = _decimal(plain) if _NUMBER.fullmatch(plain) else None
    if value is None or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(
            f"expected a whole number up to 1e18 (e.g. 4e8, 1_000_000 or 1,000,000), got {text!r}"
        )
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return int(value)


def _decimal(plain: str) -> Decimal | None:
    """Decimal, not float: 4e8 is exact and 12345678901234567e0 keeps every digit. None for
    what no count can be (an exponent so large that decimal overflows, or beyond MAX_COUNT)."""
    try:
        value = Decimal(plain.replace("_", ""))
        return value if abs(value) <= MAX_COUNT else None
    except ArithmeticError:  # decimal.Overflow
        return None


def bucket_shapes(text: str) -> list[tuple[int, ...]]:
    """'16x16,12x20' -> [(16, 16), (12, 20)] (argparse type)."""
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give shapes as HxW[,HxW...]") from None
    if any(len(s) not in (2, 3) or min(s) < 1 for s in shapes) or len({len(s) for s in shapes}) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: all HxW, or all TxHxW, of positive sides")
    return shapes


def sample_size(text: str) -> tuple[int, ...]:
    """'12x20' -> (12, 20); '8x16x16' -> (8, 16, 16) (argparse type)."""
    shapes = bucket_shapes(text)
    if len(shapes) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one size, HxW or TxHxW")
    return shapes[0]


def add_ownership_arguments(group: argparse._ArgumentGroup, *, on_demand: bool) -> None:
    """The figures plan/ownership.py prices GPU-hours with, shared by `mmtrain plan --own` and
    `mmtrain report`; `on_demand=False` where the command already has --price-per-gpu-hour.
    Each dest is a field of ownership.Given (`ownership_given` reads them by name)."""
    group.add_argument("--currency", default="USD", help="ISO code of every price (default USD)")
    group.add_argument("--horizon-months", type=float, default=36, help="months compared (36)")
    default = "; default: the catalog's sourced figure, if any, in USD"
    money = [
        ("--monthly-server-price", "one server rented for a month"),
        ("--purchase-price", "one server bought"),
        ("--power-price", "one kWh"),
        ("--hosting-per-kw-month", "colocation per kW of IT load a month, power apart"),
    ]
    if on_demand:
        money.insert(0, ("--price-per-gpu-hour", "one GPU-hour on demand"))
    for name, what in money:
        group.add_argument(name, type=float, default=None, help=what + default)
    for name, what in (
        ("--depreciation-months", "straight-line depreciation period" + default),
        ("--residual-value", "share of the purchase price left after depreciation"),
        ("--pue", "facility power over IT power" + default),
        ("--staff-fraction", "support and staff a year, as a share of the purchase price"),
        ("--utilisation", "share of the owned fleet's hours doing useful work, anyone's: the "
                          "work pays its share"),
    ):  # fmt: skip
        group.add_argument(name, type=float, default=None, help=what)


def ownership_given(args: argparse.Namespace):
    """The ownership.Given of the flags above (and of plan's --servers, --deadline-days): the
    user's figures, None where the catalog's default is to be used."""
    from dataclasses import fields

    from mmtrain.plan.ownership import Given

    names = [f.name for f in fields(Given)]
    return Given(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
