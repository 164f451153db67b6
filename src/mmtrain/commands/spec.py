"""`mmtrain spec NAME|FILE`: show a model description with its parameter, token and FLOP counts."""

from __future__ import annotations

import argparse
import json

from mmtrain.spec import load_spec, preset_names

ORDER = 10


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="show a model spec (preset or file) and its analytic counts")
    p.add_argument("model", nargs="?", help="preset name or spec YAML/JSON; omit to list presets")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        for name in preset_names():
            spec = load_spec(name)
            print(
                f"{name:28s} {spec.params() / 1e6:10.2f}M params  {spec.forward_flops() / 1e9:9.2f} GFLOPs/sample"
            )
        return 0
    spec = load_spec(args.model)
    summary = {
        "name": spec.name,
        "params": spec.params(),
        "tower_params": spec.tower_params(),
        "tokens_per_sample": spec.tokens_per_sample(),
        "forward_flops_per_sample": spec.forward_flops(),
        "tower_forward_flops": spec.tower_flops(),
        "spec": spec.to_dict(),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{spec.name}: {spec.params():,} parameters, {spec.forward_flops() / 1e9:.2f} forward GFLOPs per sample"
    )
    for name, tower in spec.towers.items():
        print(
            f"  {name:12s} {tower.modality:10s} width {tower.width:5d} x {tower.layers:3d} layers  "
            f"{tower.tokens():6d} tokens  {summary['tower_params'][name] / 1e6:9.2f}M params  "
            f"{summary['tower_forward_flops'][name] / 1e9:9.2f} GFLOPs"
        )
    if spec.pairs:
        print(f"  objective {spec.objective} over {', '.join('-'.join(p) for p in spec.pairs)}")
    if spec.fusion is not None:
        print(
            f"  fusion head: {spec.fusion.task}, {spec.fusion.num_outputs} outputs over {', '.join(spec.fused_towers())}"
        )
    return 0
