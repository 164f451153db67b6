"""`mmtrain data build|inspect|order`: make WebDataset shards, look at them and at their order.

- `build SRC --out DIR [...]`: ingest files, a table or shards into filtered shards with a
  manifest (options and work in `mmtrain.data.ingest`).
- `inspect DIR|PATTERN [--json]`: shards, samples, sample counts per extension and modality, the
  manifest's filter statistics and command, sizes and sha256 checked against the manifest,
  refused (unsafe) members and damaged shards. Exit code 1 when a shard does not match its
  manifest or is damaged.
- `order DIR|PATTERN --seed S --epoch E [--world-size W --rank R] [--skip N] [--limit N]`: the keys
  rank R reads in epoch E, one per line, after N global samples were consumed — the tool to debug
  reproducibility (`--skip` is what a resumed loader has behind it: steps x global batch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.data.ingest import add_build_arguments, run_build
from mmtrain.data.loader import planned_samples
from mmtrain.data.shards import (
    MANIFEST_NAME,
    ShardSet,
    expand_shards,
    read_manifest,
    verify_manifest,
)
from mmtrain.data.sources import EXTENSION_MODALITY

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="build and inspect WebDataset shards, show their order")
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    build = commands.add_parser("build", help="files, a table or shards -> filtered shards")
    add_build_arguments(build)
    build.set_defaults(func=run_build)

    inspect = commands.add_parser(
        "inspect", help="shards, samples, modalities; verify the manifest"
    )
    inspect.add_argument("shards", nargs="+", help="shard folder, .tar file, glob or brace pattern")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--no-hash", action="store_true", help="check sizes only, not sha256")
    inspect.set_defaults(func=run_inspect)

    order = commands.add_parser("order", help="the keys a rank reads, in order")
    order.add_argument("shards", nargs="+", help="shard folder, .tar file, glob or brace pattern")
    order.add_argument("--seed", type=int, required=True)
    order.add_argument("--epoch", type=int, required=True)
    order.add_argument("--world-size", type=int, default=1)
    order.add_argument("--rank", type=int, default=0)
    order.add_argument("--skip", type=int, default=0, help="global samples already consumed")
    order.add_argument("--limit", type=int, default=None, help="print at most N keys")
    order.add_argument(
        "--batch-size", type=int, default=1, help="per-rank batch (sets the padding)"
    )
    order.add_argument("--drop-tail", action="store_true", help="drop the tail instead of padding")
    order.add_argument("--shuffle-window", type=int, default=1000)
    order.add_argument("--no-shuffle", action="store_true", help="shard order, no shuffling")
    order.add_argument("--with-shard", action="store_true", help="print 'position shard key'")
    order.set_defaults(func=run_order)


def _spec(shards: list[str]) -> str | list[str]:
    return shards[0] if len(shards) == 1 else shards


def run_order(args: argparse.Namespace) -> int:
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is not in 0..{args.world_size - 1}")
    if args.seed < 0 or args.epoch < 0 or args.skip < 0 or args.batch_size < 1:
        raise UsageError("--seed, --epoch and --skip must be >= 0 and --batch-size >= 1")
    sources = ShardSet.open(_spec(args.shards))
    samples = planned_samples(
        sources,
        seed=args.seed,
        epoch=args.epoch,
        rank=args.rank,
        world_size=args.world_size,
        skip=args.skip,
        batch_size=args.batch_size,
        drop_tail=args.drop_tail,
        shuffle=not args.no_shuffle,
        shuffle_window=args.shuffle_window,
    )
    for n, (position, shard, key) in enumerate(samples):
        if args.limit is not None and n >= args.limit:
            break
        print(f"{position}\t{Path(shard).name}\t{key}" if args.with_shard else key)
    return 0


def inspect_shards(spec: str | list[str], check_hash: bool = True) -> dict[str, Any]:
    """The report `data inspect` prints: a plain dict, also what `--json` writes."""
    folder = Path(spec) if isinstance(spec, str) and Path(spec).is_dir() else None
    manifest = None
    if folder is not None and (folder / MANIFEST_NAME).is_file():
        manifest = read_manifest(folder)
    if manifest is not None:  # missing shards are reported by the verification below
        paths = [folder / s["name"] for s in manifest["shards"] if (folder / s["name"]).is_file()]
    else:
        paths = expand_shards(spec)
    sources = ShardSet.open(paths) if paths else ShardSet([])
    problems = [str(p) for p in verify_manifest(folder, check_hash)] if manifest else []
    listed = {s["name"]: s for s in (manifest or {}).get("shards", [])}
    shards = []
    extensions: dict[str, int] = {}
    modalities: dict[str, int] = {}
    for shard in sources.shards:
        row = {"name": shard.name, "samples": len(shard), "bytes": shard.file_bytes}
        expected = listed.get(shard.name)
        if expected is not None and expected["samples"] != len(shard):
            problems.append(
                f"{shard.name}: {len(shard)} samples, manifest says {expected['samples']}"
            )
        shards.append(row)
        for ext, n in shard.extension_counts().items():
            extensions[ext] = extensions.get(ext, 0) + n
    for ext, n in extensions.items():
        modality = EXTENSION_MODALITY.get(ext.rsplit(".", 1)[-1])
        if modality is not None:  # a sample has one member per modality
            modalities[modality] = modalities.get(modality, 0) + n
    damaged = [
        {"shard": Path(d.shard).name, "offset": d.offset, "reason": d.reason}
        for d in sources.damaged()
    ]
    problems += [f"{d['shard']}: damaged at byte {d['offset']}: {d['reason']}" for d in damaged]
    return {
        "path": str(spec),
        "manifest": manifest is not None,
        "shards": shards,
        "samples": len(sources),
        "bytes": sum(s["bytes"] for s in shards),
        "modalities": modalities,
        "extensions": dict(sorted(extensions.items())),
        "counts": (manifest or {}).get("counts", {}),
        "filters": (manifest or {}).get("filters", {}),
        "command": (manifest or {}).get("command", ""),
        "unsafe": [
            {"shard": Path(m.shard).name, "member": m.member, "reason": m.reason}
            for m in sources.skipped()
        ],
        "damaged": damaged,
        "problems": problems,
        "verified": "sha256" if manifest and check_hash else "size" if manifest else "none",
    }


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_shards(_spec(args.shards), check_hash=not args.no_hash)
    if args.json:
        print(json.dumps(report, indent=2))
        return 1 if report["problems"] else 0
    listing = ", ".join(f"{k} {v:,}" for k, v in report["modalities"].items()) or "none recognised"
    print(f"{report['path']}: {len(report['shards'])} shards, {report['samples']:,} samples, "
          f"{report['bytes'] / 2**20:,.1f} MiB")  # fmt: skip
    print(f"  modalities  {listing}")
    print(f"  extensions  {', '.join(f'{k} {v:,}' for k, v in report['extensions'].items())}")
    if report["manifest"]:
        checked = "sizes and sha256" if report["verified"] == "sha256" else "sizes"
        bad = len({p.split(":", 1)[0] for p in report["problems"]})
        print(f"  manifest    {len(report['shards']) - bad}/{len(report['shards'])} shards match "
              f"({checked})")  # fmt: skip
        if report["command"]:
            print(f"  built by    {report['command']}")
        for name, value in report["filters"].items():
            print(f"  filter      {name}: {value}")
    else:
        print("  manifest    none (shards read as they are, nothing to verify against)")
    if report["unsafe"]:
        print(f"  refused     {len(report['unsafe'])} member(s):")
        for m in report["unsafe"][:20]:
            print(f"    {m['shard']}: {m['member']}: {m['reason']}")
    for problem in report["problems"]:
        print(f"  PROBLEM     {problem}")
    return 1 if report["problems"] else 0
