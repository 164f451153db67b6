"""`mmtrain quickstart [--out DIR] [--steps N] [--minutes N] [--modalities LIST | --vlm |
--vlm-docs | --vlm-video | --diffusion]`: the offline demos of the README (code:
`mmtrain.quickstart`).

Builds the Twemoji image-caption set from the `quickstart` extra's packages, trains tiny-clip
on the CPU for a fixed number of steps (fewer if they do not fit the time budget), evaluates
retrieval on held-out emoji, writes the report and prints where to look. `--modalities
image,audio,timeseries` adds spoken captions and sensor time-series (the `modalities` extra)
as further towers bound to text. `--vlm` then trains a small vision-language model on the
emoji in LLaVA's two stages and scores its answers to "What is this?" on held-out emoji.
`--diffusion` trains a class-conditional DiT on emoji of ten classes and scores its samples
against the held-out emoji in a CLIP's features (FD, conditional accuracy). `--vlm-docs`
trains a native-resolution VLM (tiny-qwen2-vl's shape) to read numbers off small pages it
draws itself, and scores its answers on held-out pages by ANLS and CER, with their own and
with shuffled pages (no extra needed). `--vlm-video` trains the same shape of model to say
what a shape does in short clips it draws itself (moves, grows, turns), and scores its answers
on held-out clips with their frames in order and reversed (no extra needed).
Without an extra it stops (exit 2) with the command that installs it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.commands._args import count

ORDER = 5  # the first command a new user runs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart",
        help="offline demo: train a tiny CLIP on emoji in minutes on a CPU, with a report",
        description=(
            "Build an image-caption set from Twemoji (CC-BY 4.0, installed with "
            "pip install 'mmtrain[quickstart]'), train tiny-clip on the CPU for --steps "
            "(fewer if they do not fit --minutes), "
            "evaluate image->text and text->image retrieval on held-out emoji, and write "
            "OUT/run/report.html. Nothing is downloaded."
        ),
    )
    p.add_argument(
        "--out", type=Path, help="output folder (default runs/quickstart, runs/quickstart-vlm)"
    )
    p.add_argument(
        "--steps",
        type=count,
        help="training steps (default 450; fixed, so the result does not depend on machine load;"
        " with --vlm: the VLM's steps over both stages, default 600)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        help="upper bound on training time: the steps are timed on this machine first and cut "
        "to fit (default 5; building the data and the report add about a minute; with --vlm: "
        "default 4, for the CLIP and for the two VLM stages each)",
    )
    p.add_argument(
        "--batch-size", type=count, help="pairs per step (default 64; 32 with --modalities)"
    )
    p.add_argument("--limit", type=count, help="use only N emoji, evenly spaced (a faster demo)")
    p.add_argument(
        "--modalities",
        help="towers besides text, comma-separated from image, audio, timeseries (default "
        "image). audio: the emoji names spoken by eSpeak NG; timeseries: BasicMotions smartwatch "
        "sensors. Needs pip install 'mmtrain[modalities]'; default steps 900 of 32",
    )
    p.add_argument(
        "--vlm",
        action="store_true",
        help="a small vision-language model in LLaVA's two stages (projector, then projector "
        "+ LM) on a vision tower from the image-text quickstart; answers 'What is this?' about "
        "held-out emoji, scored by token F1 with their own and with shuffled images",
    )
    p.add_argument(
        "--vlm-docs",
        action="store_true",
        help="a native-resolution VLM (tiny-qwen2-vl's shape, from scratch) reads the number "
        "on small pages of four aspect ratios drawn with DejaVu Sans; its answers about "
        "held-out pages are scored by ANLS and CER, with their own and with shuffled pages "
        "(default 2000 steps of 32, --minutes default 5; --limit N: N training pages)",
    )
    p.add_argument(
        "--vlm-video",
        action="store_true",
        help="a native-resolution VLM (tiny-qwen2-vl's shape, from scratch) says what a shape "
        "does in 4-frame clips it draws (moves left/right/up/down, grows, shrinks, turns "
        "clockwise/anticlockwise); its answers about held-out (shape, motion) pairs are scored "
        "with the frames in order and reversed (default 1200 steps of 32, --minutes default 6; "
        "--limit N: N training clips)",
    )
    p.add_argument(
        "--diffusion",
        action="store_true",
        help="a small class-conditional DiT (flow matching) drawing emoji of ten classes; its "
        "samples for the held-out emoji's classes are scored against those images in the "
        "features of an image-text quickstart's CLIP (FD beside the untrained model's and the "
        "real-vs-real floor, conditional accuracy), with a sample grid",
    )
    p.add_argument(
        "--vlm-dpo",
        action="store_true",
        help="preference tuning after SFT: the --vlm-docs reader (2000 steps, into OUT/sft) "
        "tuned with train.objective dpo on pairs where the chosen answer is the page's number "
        "and the rejected one a near miss; held-out reward accuracy and exact match before and "
        "after (default 600 steps of 32 pairs)",
    )
    p.add_argument(
        "--video",
        action="store_true",
        help="a tiny Wan-shaped text-to-video model (a WanPipeline folder made here, its VAE "
        "trained first) learns clips of a square moving left, right, up or down from their "
        "captions, through encode-latents --pipeline and init: PIPELINE_DIR; its samples for "
        "each caption are judged by where their frames move, beside the untrained model's "
        "(default 600 steps of 32; needs diffusers and transformers)",
    )
    p.add_argument(
        "--clip",
        type=Path,
        help="with --vlm or --diffusion: the --out folder (or run folder) of an image-text "
        "quickstart to use (the VLM's vision tower, the DiT's feature extractor); default: "
        "train one first, into OUT/clip",
    )
    p.add_argument(
        "--clip-steps",
        type=count,
        help="with --vlm or --diffusion and no --clip: steps of the image-text model trained "
        "first (default 450)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.quickstart import make_config, run_quickstart
    from mmtrain.quickstart.config import parse_modalities
    from mmtrain.quickstart.emoji_data import MissingPackages

    demos = [flag for flag, given in (("--vlm", args.vlm), ("--vlm-docs", args.vlm_docs),
                                       ("--vlm-video", args.vlm_video),
                                       ("--diffusion", args.diffusion),
                                       ("--video", args.video),
                                       ("--vlm-dpo", args.vlm_dpo)) if given]  # fmt: skip
    if len(demos) > 1:
        count_words = {2: "two", 3: "three", 4: "four"}[len(demos)]
        raise UsageError(f"{' and '.join(demos)} are {count_words} demos; give one of them")
    if args.vlm_docs:
        return run_vlm_docs(args)
    if args.vlm_video:
        return run_vlm_video(args)
    if args.vlm:
        return run_vlm(args)
    if args.diffusion:
        return run_diffusion(args)
    if args.video:
        return run_video(args)
    if args.vlm_dpo:
        return run_vlm_dpo(args)
    if args.clip is not None or args.clip_steps is not None:
        raise UsageError("--clip and --clip-steps go with --vlm or --diffusion")
    config = make_config(
        parse_modalities(args.modalities),
        out=args.out or Path("runs/quickstart"),
        steps=args.steps,  # None: the default of the modalities chosen
        minutes=args.minutes,
        batch_size=args.batch_size,
        limit=args.limit,
    )
    progress = _Progress()
    try:
        result = run_quickstart(config, on_phase=progress.phase, on_step=progress.step)
    except MissingPackages as err:
        raise UsageError(str(err)) from None
    print(summary(result) if result.modalities == ("image",) else modalities_summary(result))
    return 0


def run_vlm(args: argparse.Namespace) -> int:
    """`--vlm`: the two-stage vision-language demo (`mmtrain.quickstart.vlm`)."""
    from mmtrain.quickstart.vlm import VlmConfig, run_vlm

    return _staged_demo(args, "--vlm", Path("runs/quickstart-vlm"), VlmConfig, run_vlm,
                        vlm_summary)  # fmt: skip


def run_vlm_docs(args: argparse.Namespace) -> int:
    """`--vlm-docs`: the document-reading demo (`mmtrain.quickstart.vlm_docs`)."""
    from mmtrain.quickstart.vlm_docs import VlmDocsConfig, run_vlm_docs

    return _native_demo(args, "--vlm-docs", VlmDocsConfig, "train_pages", run_vlm_docs,
                        vlm_docs_summary)  # fmt: skip


def run_vlm_video(args: argparse.Namespace) -> int:
    """`--vlm-video`: the clip demo (`mmtrain.quickstart.vlm_video`)."""
    from mmtrain.quickstart.vlm_video import VlmVideoConfig, run_vlm_video

    return _native_demo(args, "--vlm-video", VlmVideoConfig, "train_clips", run_vlm_video,
                        vlm_video_summary)  # fmt: skip


def _native_demo(
    args: argparse.Namespace, flag: str, make_config, limit_field: str, run_demo, summarise
) -> int:
    """A native-resolution VLM demo (`mmtrain.quickstart.native_demo`), which trains no CLIP:
    its flags checked before anything is written, its config (`--limit` sets `limit_field`,
    the training samples), its run with progress lines, its summary."""
    for name, value in (("--modalities", args.modalities), ("--clip", args.clip),
                        ("--clip-steps", args.clip_steps)):  # fmt: skip
        if value is not None:
            raise UsageError(f"{name} does not go with {flag} (it trains no CLIP)")
    given = {
        "out": args.out,  # None: the demo's own default, runs/quickstart-vlm-docs or -video
        "steps": args.steps,
        "minutes": args.minutes,
        "batch_size": args.batch_size,
        limit_field: args.limit,
    }
    config = make_config(**{name: value for name, value in given.items() if value is not None})
    config.validate()  # FieldError: exit 2, naming the flag
    progress = _Progress()
    result = run_demo(config, on_phase=progress.phase, on_step=progress.step)
    print(summarise(result))
    return 0


def run_vlm_dpo(args: argparse.Namespace) -> int:
    """`--vlm-dpo`: SFT then DPO of the document reader (`mmtrain.quickstart.vlm_dpo`)."""
    from mmtrain.quickstart.vlm_dpo import VlmDpoConfig, run_vlm_dpo

    return _standalone_demo(args, "--vlm-dpo", VlmDpoConfig, run_vlm_dpo, vlm_dpo_summary,
                            ("out", "steps", "batch_size"))  # fmt: skip


def _standalone_demo(
    args: argparse.Namespace, flag: str, make_config, run_demo, summarise, settings: tuple
) -> int:
    """A demo that takes no CLIP and no emoji: the flags it does not read refused, its config
    from the `settings` given, its run with progress lines, its summary."""
    names = {"modalities": "--modalities", "clip": "--clip", "clip_steps": "--clip-steps",
             "limit": "--limit", "minutes": "--minutes"}  # fmt: skip
    for name, shown in names.items():
        if name not in settings and getattr(args, name) is not None:
            raise UsageError(f"{shown} does not go with {flag}")
    given = {name: getattr(args, name) for name in settings}
    config = make_config(**{name: value for name, value in given.items() if value is not None})
    config.validate()
    progress = _Progress()
    result = run_demo(config, on_phase=progress.phase, on_step=progress.step)
    print(summarise(result))
    return 0


def vlm_dpo_summary(result: Any) -> str:
    """The --vlm-dpo ending: held-out reward accuracy and exact match before and after."""
    p, run = result.preference, result.paths.run
    return "\n".join([
        "",
        _done(result, f"{result.steps} DPO steps after the reader's SFT"),
        "",
        f"{p['n']} held-out pairs (the page's number chosen, a near miss rejected; beta "
        f"{p['beta']:g}):",
        f"  reward accuracy   {_pct(p['reward_accuracy'])} after   "
        f"{_pct(p['reward_accuracy_before'])} before (the reference itself: every tie half)",
        f"  control           {_pct(p['reward_accuracy_sharper_reference'])} the reader with its "
        "logits doubled, nothing trained",
        f"  exact match       {_pct(p['exact_match'])} after   {_pct(p['exact_match_before'])} "
        "before (greedy answers on the held-out pages)",
        "",
        f"run         {run}  (the reader with its tuned final norm and head)",
        f"eval.json   {run / 'eval.json'}",
    ])  # fmt: skip


def run_video(args: argparse.Namespace) -> int:
    """`--video`: the text-to-video demo through a Wan pipeline folder
    (`mmtrain.quickstart.video_diffusion`)."""
    from mmtrain.quickstart.video_diffusion import VideoDemoConfig, run_video_demo

    return _standalone_demo(args, "--video", VideoDemoConfig, run_video_demo, video_summary,
                            ("out", "steps", "minutes", "batch_size"))  # fmt: skip


def video_summary(result: Any) -> str:
    """The --video ending: how often samples move as their caption says, beside the untrained
    model's, chance and the drawn clips' through the VAE, then where to look."""
    v, run = result.video, result.paths.run
    lines = [
        "",
        _done(result, f"{result.steps} steps on {result.n_train} training clips"),
        "",
        f"{v['n']} clips sampled ({v['samples_per_caption']} per caption, guidance {v['cfg']}), "
        "judged by where their frames move:",
        f"  moves as captioned  {_pct(v['accuracy'])} trained   {_pct(v['accuracy_untrained'])} "
        f"untrained   {_pct(v['chance'])} chance   {_pct(v['accuracy_drawn_through_vae'])} drawn "
        "clips through the VAE (the ceiling)",
        "  by direction        " + "   ".join(f"{d} {_pct(a)}" for d, a in v["by_direction"].items()),
        "",
        f"samples     {run / 'samples'}/ (an MP4 per clip)",
        f"pipeline    {run}  (DiffusionPipeline.from_pretrained opens it; EMA in {run / 'ema'})",
        f"report      {result.report_html}",
        f"eval.json   {run / 'eval.json'}",
    ]
    return "\n".join(lines)


def run_diffusion(args: argparse.Namespace) -> int:
    """`--diffusion`: the class-conditional DiT demo (`mmtrain.quickstart.diffusion`)."""
    from mmtrain.quickstart.diffusion import DiffusionDemoConfig, run_diffusion_demo

    return _staged_demo(args, "--diffusion", Path("runs/quickstart-diffusion"),
                        DiffusionDemoConfig, run_diffusion_demo, diffusion_summary)  # fmt: skip


def _staged_demo(
    args: argparse.Namespace, flag: str, default_out: Path, make_config, run_demo, summarise
) -> int:
    """A demo that starts from the image-text quickstart's CLIP (stage 0, or `--clip`): its
    config from the flags given, its run with progress lines, its summary."""
    from mmtrain.quickstart.emoji_data import MissingPackages

    if args.modalities is not None:
        raise UsageError(f"{flag} and --modalities are two demos; give one of them")
    given = {
        "out": args.out or default_out,
        "steps": args.steps,
        "minutes": args.minutes,
        "batch_size": args.batch_size,
        "limit": args.limit,
        "clip": args.clip,
        "clip_steps": args.clip_steps,
    }
    config = make_config(**{name: value for name, value in given.items() if value is not None})
    progress = _Progress()
    try:
        result = run_demo(config, on_phase=progress.phase, on_step=progress.step)
    except MissingPackages as err:
        raise UsageError(str(err)) from None
    print(summarise(result))
    return 0


class _Progress:
    """A line per stage and one every 10 training steps (or a live line on a terminal)."""

    NAMES = {
        "data": "building the emoji data set (mmtrain data build)",
        "pages": "drawing the pages and building their shards (mmtrain data build)",
        "clips": "drawing the clips and building their shards (mmtrain data build)",
        "calibrate": "timing a few steps against the time budget",
        "train": "training (mmtrain train)",
        "evaluate": "evaluating on the held-out data (mmtrain eval)",
        "report": "writing the report (mmtrain report)",
        "clip": "stage 0, the CLIP: the image-text quickstart",
        "stage1": "stage 1, training the projector (mmtrain train)",
        "stage2": "stage 2, training the projector and the LM (mmtrain train)",
        "pipeline": "stage 0, the pipeline folder",
        "latents": "drawing the clips and encoding them (mmtrain data encode-latents --pipeline)",
        "judge": "sampling through the pipeline (mmtrain generate) and judging the motion",
        "pairs": "building the preference pairs (mmtrain data build)",
    }

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()

    def phase(self, name: str, detail: str) -> None:
        when = _clock(time.monotonic() - self.start)
        stage, _, inner = name.rpartition(":")  # "clip:train": a stage of the CLIP's run
        title = self.NAMES.get(inner, inner)
        print(f"[{when}] {f'{stage}: ' if stage else ''}{title}: {detail}", flush=True)

    def step(self, row: dict[str, Any]) -> None:
        text = f"  step {row['step']}/{row['total_steps']}  loss {row['loss']:.3f}"
        recall = row.get("val/retrieval/image->text/R@5")
        if recall is not None:
            text += f"  held-out image->text R@5 {100 * recall:.1f}%"
        if self.tty:
            sys.stderr.write(f"\r{text}\033[K")
            if recall is not None:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif row["step"] % 10 == 0 or recall is not None:
            print(text, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def summary(result: Any) -> str:
    """What the user reads at the end: the numbers against chance, then where to look."""
    lines = [
        "",
        _done(result, f"{result.steps} steps on {result.n_train} training pairs"),
        "",
        f"held-out retrieval on {result.n_val} emoji never seen in training "
        f"(chance: R@1 {_pct(result.chance['R@1'])}, R@5 {_pct(result.chance['R@5'])})",
    ]
    for direction, metrics in result.retrieval.items():
        lines.append(
            f"  {direction:<12} R@1 {_pct(metrics['R@1']):>6}   R@5 {_pct(metrics['R@5']):>6}   "
            f"({metrics['R@5'] / result.chance['R@5']:.0f}x chance at R@5)"
        )
    paths = result.paths
    data = f"{paths.train_shards}, {paths.val_shards}  (licence: {paths.out / 'ATTRIBUTION.txt'})"
    return "\n".join(lines + _where(result, data))


def _done(result: Any, trained: str) -> str:
    """Every summary's first line: how long in all and per stage, then what was trained."""
    seconds = result.seconds
    stages = ", ".join(f"{name} {_clock(s)}" for name, s in seconds.items())
    return f"done in {_clock(sum(seconds.values()))} ({stages}); {trained}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def modalities_summary(result: Any) -> str:
    """The --modalities ending: every direction against its chance level, zero-shot accuracy,
    then where to look."""
    held = ", ".join(f"{n} {m}" for m, n in result.n_by_modality.items())
    lines = [
        "",
        _done(result, f"{result.steps} steps on {result.n_train} training pairs"),
        "",
        f"held-out retrieval, never seen in training ({held} pairs):",
        f"  {'direction':<18} {'R@1':>6} {'R@5':>6} {'R@10':>6}   chance R@1 / R@5 / R@10",
    ]
    for direction, metrics in result.retrieval.items():
        chance = result.chance_by_direction[direction]
        lines.append(
            f"  {direction:<18} {_pct(metrics['R@1']):>6} {_pct(metrics['R@5']):>6} "
            f"{_pct(metrics['R@10']):>6}   {_pct(chance['R@1'])} / {_pct(chance['R@5'])} / "
            f"{_pct(chance['R@10'])}"
        )
    for tower, metrics in result.zeroshot.items():
        chance = result.chance_by_direction.get(f"zeroshot/{tower}", {}).get("top1")
        lines.append(
            f"  zero-shot {tower} top-1 {_pct(metrics['top1'])} over {metrics['n_classes']} "
            f"classes (chance {_pct(chance) if chance is not None else '-'})"
        )
    paths = result.paths
    data = f"{paths.out / 'data'}  (licences: {paths.out / 'ATTRIBUTION.txt'})"
    return "\n".join(lines + _where(result, data))


def vlm_summary(result: Any) -> str:
    """The --vlm ending: held-out answer scores with own and shuffled images, a few answers,
    then where to look."""
    steps = result.steps
    clip = f"CLIP {steps['clip']} steps" if steps["clip"] else f"CLIP from {result.clip_run}"
    generation = result.generation
    lines = [
        "",
        _done(
            result,
            f"{clip}, projector {steps['stage1']} steps, projector + LM {steps['stage2']} steps, "
            f"on {result.n_train} training emoji",
        ),
        "",
    ]
    if "token_f1" not in generation:
        lines.append(f"no answers were generated: {generation.get('skipped', 'see eval.json')}")
    else:
        lines += [
            f'answers to "What is this?" about {generation["n"]} held-out emoji never seen in '
            "training, against their names:",
            f"  token F1 {_pct(generation['token_f1'])} with their own images, "
            f"{_pct(generation['token_f1_shuffled_images'])} with images shuffled between "
            f"samples; exact match {_pct(generation['exact_match'])}",
        ]
    for example in result.examples[:5]:
        shuffled = example.get("generated_shuffled_images")
        lines.append(
            f"  {example['reference']!r} -> {example['generated']!r}"
            + (f"  (shuffled image: {shuffled!r})" if shuffled is not None else "")
        )
    run = result.paths.run
    return "\n".join(
        lines
        + [
            "",
            f"eval.json   {result.eval_json}",
            f"run folder  {run}  (config.yaml, metrics.jsonl, model.safetensors); stage 1 in "
            f"{result.paths.stage1}",
            f"data        {result.paths.out / 'data'}, tokenizer {result.paths.tokenizer}  "
            f"(licence: {result.paths.out / 'ATTRIBUTION.txt'})",
        ]
    )


def vlm_docs_summary(result: Any) -> str:
    """The --vlm-docs ending: ANLS with own and shuffled pages, CER and exact match, in all and
    per page shape, the pages' tokens against the budget, the pages misread, then where to
    look."""
    d = result.documents
    tokens = d["page_tokens"]
    lines = [
        "",
        _done(result, f"{result.steps} steps on {result.n_train} training pages"),
        "",
    ]
    if d.get("anls") is None:
        lines.append("no answers were generated: see eval.json")
    else:
        lines += [
            f'"{d["prompt"]}" on {d["n"]} held-out pages, numbers never on a training page:',
            f"  {'pages':<8} {'tokens':>8} {'n':>4} {'ANLS':>7} {'shuffled':>9} {'exact':>7}",
            f"  {'all':<8} {tokens['min']:>4}-{tokens['max']:<3} {d['n']:>4} "
            f"{_pct(d['anls']):>7} {_pct(d['anls_shuffled_pages']):>9} "
            f"{_pct(d['exact_match']):>7}",
        ]
        for shape, row in d.get("by_shape", {}).items():
            if row["n"]:
                lines.append(
                    f"  {shape:<8} {row['tokens']:>8} {row['n']:>4} {_pct(row['anls']):>7} "
                    f"{_pct(row['anls_shuffled_pages']):>9} {_pct(row['exact_match']):>7}"
                )
        lines.append(
            f"  CER {_pct(d['cer'])} with their own pages (character edits per reference "
            "character); shuffled: another held-out page under the same question"
        )
    lines.append(
        f"  tokens per page: min {tokens['min']}, mean {tokens['mean']:.1f}, max "
        f"{tokens['max']} of {tokens['pages']} pages (budget: image_min_tokens "
        f"{tokens['image_min_tokens']}, image_max_tokens {tokens['image_max_tokens']}, "
        f"sample_max_tokens {tokens['sample_max_tokens']})"
    )
    misread = d.get("misread", [])
    if misread:
        shown = ", ".join(f"{m['reference']!r} -> {m['generated']!r} ({m['shape']})"
                          for m in misread[:6])  # fmt: skip
        more = f" and {len(misread) - 6} more" if len(misread) > 6 else ""
        lines.append(f"  misread: {shown}{more}")
    return "\n".join(lines + _native_where(result, "documents", "pages", "*.png", "font licence"))


def vlm_video_summary(result: Any) -> str:
    """The --vlm-video ending: accuracy with the frames in order and reversed, in all and per
    motion, how often a reversed clip gets the opposite motion, then where to look."""
    v = result.video
    lines = [
        "",
        _done(result, f"{result.steps} steps on {result.n_train} training clips"),
        "",
    ]
    if v.get("accuracy") is None:
        lines.append("no answers were generated: see eval.json")
    else:
        lines += [
            f'"{v["prompt"]}" on {v["n"]} held-out clips, (shape, motion) pairs on no training '
            f"clip (chance {_pct(v['chance'])}):",
            f"  {'motion':<20} {'n':>4} {'in order':>9} {'reversed':>9} {'opposite':>9}",
            f"  {'all':<20} {v['n']:>4} {_pct(v['accuracy']):>9} "
            f"{_pct(v['accuracy_frames_reversed']):>9} {_pct(v['reversed_as_opposite']):>9}",
        ]
        for motion, row in v.get("by_motion", {}).items():
            if row["n"]:
                lines.append(
                    f"  {motion:<20} {row['n']:>4} {_pct(row['accuracy']):>9} "
                    f"{_pct(row['accuracy_frames_reversed']):>9} "
                    f"{_pct(row['reversed_as_opposite']):>9}"
                )
        lines.append(
            "  reversed: the same clips with their frames last to first, scored against the "
            "clip's own motion; opposite: reversed clips answered with the reverse motion"
        )
        if v.get("accuracy_shuffled_clips") is not None:
            lines.append(
                f"  with another held-out clip under the same question: "
                f"{_pct(v['accuracy_shuffled_clips'])}"
            )
    lines.append(f"  held out: {', '.join(v['held_out'])}; {v['clip_tokens']} tokens per clip")
    return "\n".join(lines + _native_where(result, "video", "clips", "*.mp4", "about the clips"))


def _native_where(result: Any, block: str, label: str, pattern: str, attribution: str) -> list[str]:
    """The closing lines of `--vlm-docs` and `--vlm-video`: eval.json and the `block` the demo
    added, the run folder, the raw files (`label`, `pattern` in each split) and the shards,
    the tokenizer and ATTRIBUTION.txt (`attribution` says what it is about)."""
    paths = result.paths
    return [
        "",
        f'eval.json   {result.eval_json}  ("{block}", "generation", "examples")',
        f"run folder  {paths.run}  (config.yaml, metrics.jsonl, model.safetensors)",
        f"{label:<12}{paths.raw}/{{train,val}}/{pattern}, shards {paths.train_shards}, "
        f"{paths.val_shards}",
        f"tokenizer   {paths.tokenizer}  ({attribution}: {paths.out / 'ATTRIBUTION.txt'})",
    ]


def diffusion_summary(result: Any) -> str:
    """The --diffusion ending: FD against the untrained model and the floor, conditional
    accuracy against the real images', then where to look."""
    steps = result.steps
    clip = f"CLIP {steps['clip']} steps" if steps["clip"] else f"CLIP from {result.clip_run}"
    d = result.diffusion
    lines = [
        "",
        _done(result, f"{clip}, DiT {steps['dit']} steps on {result.n_train} training emoji"),
        "",
        f"{d['fd_n']} samples for the classes of held-out emoji never seen in training, against "
        f"those images, in the features of {d['extractor']} (lower is closer):",
        f"  Fréchet distance  {d['fd']:.3f} trained   {d['fd_untrained']:.3f} untrained",
        f"  at half the n     {d['fd_half']:.3f} trained   {d['fd_half_untrained']:.3f} untrained   "
        f"{d['fd_real_floor']:.3f} real vs real (the floor: FD's bias at this n)",
    ]
    if "cond_accuracy" in d:
        lines.append(
            f"  class accuracy    {_pct(d['cond_accuracy'])} trained   "
            f"{_pct(d['cond_accuracy_untrained'])} untrained   {_pct(d['real_accuracy'])} real "
            "images (zero-shot by the CLIP: its ceiling)"
        )
    paths = result.paths
    return "\n".join(
        lines
        + [
            "",
            f"samples     {result.grid}  (a row per class), {paths.run / 'samples'}/ (per "
            "validation)",
            f"report      {result.report_html}",
            f"eval.json   {result.eval_json}",
            f"run folder  {paths.run}  (config.yaml, metrics.jsonl, model.safetensors, ema/)",
            f"data        {paths.train_shards}, {paths.val_shards}  (licence: "
            f"{paths.out / 'ATTRIBUTION.txt'})",
        ]
    )


def _where(result: Any, data: str) -> list[str]:
    """The closing lines: where the report, the metrics, the run and the data are."""
    return [
        "",
        f"report      {result.report_html}",
        f"eval.json   {result.eval_json}",
        f"run folder  {result.paths.run}  (config.yaml, metrics.jsonl, tensorboard/, "
        "model.safetensors)",
        f"data        {data}",
    ]
