"""`mmtrain train CONFIG.yaml [key=value ...]`: train, or resume, the run the config describes."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from mmtrain.config import load_config
from mmtrain.structured import FieldError

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a run config (running it again resumes)",
        description=(
            "Train the model of CONFIG.yaml into its run folder (`out`). Running the same "
            "command again resumes from the newest valid checkpoint. Under torchrun, every "
            "rank runs this command (DDP over gloo on CPU, nccl on GPU)."
        ),
    )
    p.add_argument("config", help="run config YAML (see configs/tiny-clip.yaml)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. train.lr=1e-3 out=runs/a",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from mmtrain import distributed  # torch is imported only when training
    from mmtrain.train.loop import train

    progress = _Progress(config.train.steps, config.metrics.log_every)
    hints = _Hints(config.out, tty=progress.tty)

    def on_step(row: dict[str, Any]) -> None:
        progress(row)
        hints(row)

    try:
        result = train(config, on_step=on_step)
    except Exception as err:
        if isinstance(err, FieldError) or distributed.world_size() == 1:
            raise
        _exit_rank(err, config.out)
    progress.close()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the summary and hints are rank 0's to print (every rank has the same)
    hints.close()
    if result.resumed_from is not None and result.resumed_from >= config.train.steps:
        print(f"already finished: {result.step} steps; weights in {_weights(result.out)}")
        return 0
    if result.resumed_from is not None:
        print(f"resumed from step {result.resumed_from}")
    if result.stopped_by_signal:
        where = (
            f"its checkpoint in {result.out}/checkpoints resumes the run"
            if result.step
            else "no step was trained, nothing to resume"
        )
        print(f"stopped by a signal at step {result.step}; {where}")
        return 0
    print(
        f"done: {result.step} steps, {result.samples_seen} samples, last loss {result.last_loss:.4f}, "
        f"{result.skipped_steps} skipped steps, {result.corrupt_samples} corrupt samples; "
        f"weights in {_weights(result.out)}"
    )
    return 0


def _weights(out: Path) -> str:
    """Where a finished run's weights are: a pipeline's transformer folder (a hub denoiser),
    else the run folder's model.safetensors (or its shards' index)."""
    if (out / "model_index.json").is_file():
        return f"{out}/transformer/ (a diffusers pipeline folder: {out})"
    if (out / "model.safetensors.index.json").is_file():
        return f"{out}/model.safetensors.index.json"
    return f"{out}/model.safetensors"


_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "timed out", "peer")


def _exit_rank(err: Exception, out: str) -> None:
    """Print why this rank stops and what to do, then exit at once. A normal exit would tear
    down the process group, which can wait forever for a peer that is gone; the job's other
    ranks see this one leave and stop the same way, so the whole job ends instead of hanging."""
    from mmtrain import distributed

    traceback.print_exc()
    rank, world = distributed.rank(), distributed.world_size()
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    peer = any(words in first_line.lower() for words in _PEER_WORDS)
    cause = "another rank of this job stopped or was killed (its log says why)" if peer else ""
    print(
        f"error: rank {rank} of {world} stopped: {first_line}\n"
        + (f"  cause: {cause}\n" if cause else "")
        + "  restart every rank with the same command: training resumes from the newest "
        f"valid checkpoint in {out}/checkpoints",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class _Progress:
    """A one-line progress bar with ETA on a terminal; a summary line every N steps otherwise."""

    def __init__(self, total: int, every: int):
        self.total = total
        self.every = every
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.first_step: int | None = None

    def __call__(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if self.first_step is None:
            self.first_step = step - 1
            self.start = time.monotonic()
        done = step - self.first_step
        elapsed = time.monotonic() - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        text = (
            f"step {step}/{self.total}  loss {row['loss']:.4f}  lr {_learning_rates(row)}  "
            f"{row['samples_per_s']:.1f} samples/s  data wait {100 * row['data_wait_fraction']:.0f}%"
            + (f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "")
            + f"  ETA {_duration(eta)}"
        )
        if self.tty:
            width = 24
            filled = int(width * step / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
            sys.stderr.flush()
        elif step % self.every == 0 or step == self.total:
            print(text, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


class _Hints:
    """A line in the training log when `mmtrain doctor` would first name a problem: the run
    folder is diagnosed at most once every HINT_EVERY_S seconds (reading metrics.jsonl is
    milliseconds to a second, between steps) and once at the end; each kind is named once."""

    HINT_EVERY_S = 60.0

    def __init__(self, out: str, *, tty: bool):
        self.out, self.tty = out, tty
        self.named: set[str] = set()
        self.last_check = -self.HINT_EVERY_S

    def __call__(self, row: dict[str, Any]) -> None:
        if time.monotonic() - self.last_check >= self.HINT_EVERY_S:
            self.check()

    def check(self) -> None:
        from mmtrain.report.doctor import diagnose
        from mmtrain.report.rundata import load_run

        self.last_check = time.monotonic()
        for finding in diagnose(load_run(self.out)):
            if finding.kind not in self.named:
                self.named.add(finding.kind)
                start = "\r\033[K" if self.tty else ""  # over the progress bar, which redraws
                print(
                    f"{start}hint: {finding.kind} ({finding.span()}): {finding.why}; "
                    f"change: {finding.advice} (evidence: mmtrain doctor {self.out})",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        self.check()


def _learning_rates(row: dict[str, Any]) -> str:
    """The run's lr (its main tower's: a language model's decoder) and beside it the towers
    whose lr differs: `1.20e-03 (image 5.90e-05)`."""
    from mmtrain.train.optim import per_tower, row_tower_lrs

    return per_tower(row_tower_lrs(row), usual=row["lr"], style=".2e")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
