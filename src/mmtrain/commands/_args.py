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
    group.add_argument("--currency", default="USD", metavar="CODE",
                       help="ISO 4217 code of every price given (default USD)")  # fmt: skip
    group.add_argument("--horizon-months", type=float, default=36, metavar="MONTHS",
                       help="months compared (default 36)")  # fmt: skip
    sourced = "default: hardware/ownership.yaml's sourced figure, if any"
    money = [  # (flag, what one price buys, its default: the catalog's prices are USD)
        ("--monthly-server-price", "one server rented for a month", "no default: without it "
                                   "`plan --own` leaves the monthly option out (`report` "
                                   "needs it)"),
        ("--purchase-price", "one server bought", f"{sourced} (USD only)"),
        ("--power-price", "one kWh of energy", f"{sourced} (USD only)"),
        ("--hosting-per-kw-month", "colocation per kW of IT load a month, energy apart",
         f"{sourced} (USD only)"),
    ]  # fmt: skip
    if on_demand:
        csv = "default: gpus.csv's indicative price (USD only)"
        money.insert(0, ("--price-per-gpu-hour", "one GPU-hour on demand", csv))
    for name, what, default in money:
        group.add_argument(name, type=float, default=None, metavar="PRICE",
                           help=f"{what}, in --currency; {default}")  # fmt: skip
    no_resale = "no resale, the conservative case for buying"
    for name, metavar, what in (
        ("--depreciation-months", "MONTHS", f"straight-line depreciation period in months; "
                                            f"{sourced}"),
        ("--residual-value", "SHARE", f"share (0 to 1) of the purchase price left after "
                                      f"depreciation; default 0 ({no_resale})"),
        ("--pue", "RATIO", f"facility power over IT power, a ratio >= 1; {sourced}"),
        ("--staff-fraction", "SHARE", "support and staff a year, as a share of the purchase "
                                      "price (0.1: a tenth a year); default 0 (none counted, "
                                      "which favours buying)"),
        ("--utilisation", "SHARE", "share (0 to 1) of the owned fleet's hours doing useful "
                                   "work, anyone's: the work pays its share"),
    ):  # fmt: skip
        group.add_argument(name, type=float, default=None, metavar=metavar, help=what)


def ownership_given(args: argparse.Namespace):
    """The ownership.Given of the flags above (and of plan's --servers, --deadline-days): the
    user's figures, None where the catalog's default is to be used."""
    from dataclasses import fields

    from mmtrain.plan.ownership import Given

    names = [f.name for f in fields(Given)]
    return Given(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
