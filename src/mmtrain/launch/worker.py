"""`python -m mmtrain.launch.worker COMMAND ...`: `mmtrain COMMAND ...` as a rank of a job.

`launch slurm` and `launch local` start torchrun with SIGTERM ignored (the ranks get it
directly: see `mmtrain.launch.slurm`), and an ignored signal stays ignored across fork and exec. A rank must not inherit that: it puts
SIGTERM and SIGINT back to their default actions before anything else, so that a signal that
arrives before the training loop installs its handler (finish the step, checkpoint, exit 0)
still ends the rank instead of being lost.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    from mmtrain.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
