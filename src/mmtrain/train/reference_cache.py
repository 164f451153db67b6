"""DPO's cached reference log-probs (train.dpo.reference: cache, a full fine-tune's default).

Before the first step every training pair is scored once by the model as the run starts (the
reference: `init`, or the seed's random init), without gradients, under the run's autocast:
the summed log-probs of its chosen and of its rejected answer, as train/dpo.py scores them in
a step, from micro-batches laid out as the step's are (`TrainData.pairs_once`: every pair
once, unshuffled, each rank its share). Steps then read a pair's two values by its sample id
(the loader's flat id, the batch's `pair_index`): no frozen copy in memory and no reference
forward in a step, so a run of E epochs pays one reference forward a pair instead of E.

Beside the run, in OUT/reference_logps/:
- `part-RRR-NNNNN.safetensors`: pairs rank R scored (`index` int64 [n], `logps` float64
  [n, 2]: chosen, rejected), written atomically every `PART_BATCHES` micro-batches, the
  pass's identity in their metadata;
- `complete.json`: the identity and the pair count, once every rank is done.

The identity is what the stored values depend on: the model file, `init` and its files'
sha256, the seed, the precision and the data (each source's shard names and sizes, the row
length, packing). A pass cut short (the run stopped before its first step) goes on from its
parts: micro-batches whose pairs are all scored are read again but not scored. Parts of
another identity are deleted before a new pass; a run past its first step whose values are
missing or of another identity stops with an error naming the folder (they cannot be scored
again: the model has moved on).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from mmtrain.atomic import atomic_open, atomic_write_text
from mmtrain.distributed import agree_any
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

FOLDER = "reference_logps"
COMPLETE_FILE = "complete.json"
PART_BATCHES = 64  # micro-batches a part holds: what a stopped pass scores again at most
IDENTITY_KEY = "identity"


class ReferenceLogps:
    """The reference's summed answer log-probs of every pair, by its sample id: `values`
    [samples, 2] float64 (chosen, rejected), NaN where no pair was scored (not a pair, refused)."""

    def __init__(self, values: np.ndarray, folder: Path):
        self.values, self.folder = values, folder

    def lookup(self, index: Sequence[int], device: torch.device) -> torch.Tensor:
        """The micro-batch's reference log-probs [2n], chosen sides first, on `device`."""
        rows = self.values[np.asarray(index, dtype=np.int64)]
        missing = np.isnan(rows).any(axis=1)
        if missing.any():
            raise RuntimeError(
                f"pair sample {int(np.asarray(index)[missing][0])} has no cached reference "
                f"log-probs in {self.folder}: the training data changed after the pass; start "
                "the run again in a new folder, or set train.dpo.reference: copy"
            )
        host = torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1))
        if device.type == "cuda":  # a page-locked copy goes without blocking the host
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)


def identity_of(config: Any, fingerprints: Sequence[str]) -> dict[str, Any]:
    """What the stored values depend on (module docstring): the run's config and each
    source's shard fingerprint."""
    data = config.data
    return {
        "model": str(config.model),
        "init": config.init,
        "init_sha256": dict(config.init_sha256),
        "seed": config.seed,
        "precision": config.train.precision,
        "sources": list(fingerprints),
        "sequence_length": data.sequence_length,
        "pack": bool(data.pack),
    }


class ReferencePass:
    """Scores, stores and reads the run's cached reference log-probs (module docstring).

    `score(batch) -> [2n]` is the reference's log-probs of a host micro-batch (the loop moves
    it to the device and runs the model without gradients); `barrier()` waits for every rank.
    """

    def __init__(
        self,
        out: Path,
        identity: Mapping[str, Any],
        samples: int,
        rank: int,
        barrier: Callable[[], None],
        part_batches: int = PART_BATCHES,
    ):
        self.folder = Path(out) / FOLDER
        self.identity = json.loads(json.dumps(identity))  # as it reads back from a file
        self.samples, self.rank, self.barrier = samples, rank, barrier
        self.part_batches = part_batches
        self._next_part: int | None = None  # the number of this rank's next part

    def complete(self) -> bool:
        """Whether a finished pass of this identity is stored."""
        path = self.folder / COMPLETE_FILE
        if not path.is_file():
            return False
        return json.loads(path.read_text(encoding="utf-8")).get(IDENTITY_KEY) == self.identity

    def load(self) -> ReferenceLogps:
        """The stored values of a finished pass; a FieldError naming the folder otherwise (a
        resumed run, which cannot score them again)."""
        if not self.complete():
            raise FieldError(
                "train.dpo.reference",
                f"cache: {self.folder} holds no finished reference pass of this run's model, "
                "data and precision, and the model has trained since its first step, so the "
                "reference cannot be scored again; resume with the settings the run started "
                "with, or start a new run",
            )
        return ReferenceLogps(self._read_parts(), self.folder)

    def run(
        self, batches: Iterable[dict[str, Any]], score: Callable[[dict], torch.Tensor]
    ) -> ReferenceLogps:
        """Score every pair `batches` (this rank's share of one epoch) holds that the parts do
        not, store them, and return every rank's values."""
        if self.rank == 0:
            self._delete_stale()
        self.barrier()
        values = self._read_parts()
        start, scored, pending = time.perf_counter(), 0, []
        for batch in batches:
            index = np.asarray(batch.pop("__index__"), dtype=np.int64)
            batch.pop("__key__", None)
            # Every rank scores the micro-batch, or none: a sharded model's forward is a
            # collective.
            if agree_any([bool(np.isnan(values[index]).any())])[0]:
                logps = score(batch).detach().double().cpu().numpy()
                pairs = np.ascontiguousarray(logps.reshape(2, -1).T)  # [n, 2]
                values[index] = pairs
                pending.append((index, pairs))
                scored += len(index)
            if len(pending) == self.part_batches:
                self._write_part(pending)
                pending = []
                log.info("reference pass: %d pairs scored (rank %d)", scored, self.rank)
        if pending:
            self._write_part(pending)
        log.info("reference log-probs of %d pairs scored in %.1f s (rank %d)",
                 scored, time.perf_counter() - start, self.rank)  # fmt: skip
        self.barrier()
        values = self._read_parts()  # every rank's
        if self.rank == 0:
            count = int((~np.isnan(values[:, 0])).sum())
            record = {IDENTITY_KEY: self.identity, "pairs": count}
            atomic_write_text(self.folder / COMPLETE_FILE, json.dumps(record, indent=2) + "\n")
        self.barrier()
        return ReferenceLogps(values, self.folder)

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.safetensors"))

    def _part_identity(self, path: Path) -> Any:
        with safe_open(path, "np") as f:
            return json.loads((f.metadata() or {}).get(IDENTITY_KEY, "null"))

    def _delete_stale(self) -> None:
        """Parts and the completion record of another identity: a changed run starts anew."""
        for path in self._parts():
            if self._part_identity(path) != self.identity:
                path.unlink()
        complete = self.folder / COMPLETE_FILE
        if complete.is_file() and not self.complete():
            complete.unlink()

    def _read_parts(self) -> np.ndarray:
        values = np.full((self.samples, 2), np.nan, dtype=np.float64)
        for path in self._parts():
            with safe_open(path, "np") as f:
                if json.loads((f.metadata() or {}).get(IDENTITY_KEY, "null")) != self.identity:
                    continue
                index, logps = f.get_tensor("index"), f.get_tensor("logps")
            if index.size and int(index.max()) >= self.samples:
                raise RuntimeError(f"{path}: sample ids beyond the run's {self.samples} samples")
            values[index] = logps
        return values

    def _write_part(self, pending: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._next_part is None:  # after this rank's parts of a stopped pass
            mine = [p for p in self._parts() if p.name.startswith(f"part-{self.rank:03d}-")]
            self._next_part = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in mine), default=-1)
        number, self._next_part = self._next_part, self._next_part + 1
        tensors = {
            "index": torch.from_numpy(np.concatenate([i for i, _ in pending])),
            "logps": torch.from_numpy(np.concatenate([v for _, v in pending])),
        }
        path = self.folder / f"part-{self.rank:03d}-{number:05d}.safetensors"
        with atomic_open(path) as f:
            f.write(save(tensors, metadata={IDENTITY_KEY: json.dumps(self.identity)}))
