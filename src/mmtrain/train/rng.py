"""Capture and restore every random number generator a run touches, in a form that
`torch.load(weights_only=True)` reads back (tensors, ints, strings and lists only)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed the global generators once per fresh run, for code we do not control; mmtrain's
    own randomness (init, data order, augmentation) comes from explicit generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective under torch.distributed)."""
    import torch.distributed as dist

    mine = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rank_rng_state(saved: Any, rank: int, seed: int, step: int) -> None:
    """This rank's entry of the saved list (a dict: a checkpoint of a single-state format);
    ranks the checkpoint has no entry for seed from (seed, rank, step).

    Resumed on the same number of ranks, each rank restores its own states. On a different
    number, ranks beyond the saved count seed their global generators: mmtrain's own
    randomness never comes from them, so the data stream and the weights do not depend on it.
    """
    states = [saved] if isinstance(saved, dict) else list(saved)
    if rank < len(states):
        restore_rng_state(states[rank])
    else:
        log.info("rank %d has no saved RNG state (saved by %d ranks): seeding", rank, len(states))
        seed_everything(seed * 1_000_003 + rank * 7_919 + step)
