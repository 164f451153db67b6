"""Sensor time-series for `mmtrain quickstart --modalities timeseries`: BasicMotions, offline.

BasicMotions (UEA multivariate archive; Bagnall et al. 2018, https://timeseriesclassification.com)
holds 80 recordings of a smartwatch's 3-axis accelerometer and 3-axis gyroscope (6 channels,
100 steps at 10 Hz) while a person was standing, walking, running or playing badminton; 40 for
training and 40 for testing. The `sktime` wheel (BSD-3-Clause, an optional extra) ships both
splits as `.ts` files. They are located without importing sktime (which pulls in pandas and
takes seconds) and parsed here: the format is small and documented by sktime
(`sktime/datasets/_readers_writers/ts.py`; https://www.sktime.net, "Loading data").

A `.ts` file: `#` comment lines, `@tag value` header lines, `@data`, then one line per series:
the dimensions separated by `:`, the values of each dimension by `,`, and (with
`@classLabel true L1 L2 ...`) the class label as the last `:` field. `?` is a missing value.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SERIES_PACKAGE = "sktime"
BASIC_MOTIONS = Path("datasets") / "data" / "BasicMotions"

# Class label in the .ts file -> what the person was doing, as a caption says it.
ACTIVITIES = {
    "Standing": "standing still",
    "Walking": "walking",
    "Running": "running",
    "Badminton": "playing badminton",
}
# Training captions: one template per recording (by hash of its key). Zero-shot uses others.
CAPTION_TEMPLATES = (
    "a person {}",
    "someone {}",
    "a person who is {}",
    "smartwatch motion of a person {}",
    "the wearer is {}",
)
ZEROSHOT_TEMPLATES = ("a person {}", "someone {}", "the wearer is {}")


class TsFormatError(ValueError):
    """A `.ts` file that does not follow the format; the message names the file and line."""

    def __init__(self, path: Path, line: int, reason: str):
        self.path, self.line = path, line
        super().__init__(f"{path}:{line}: {reason}")


@dataclass
class TsDataset:
    """The series of one `.ts` file, all of one length."""

    name: str  # @problemName
    series: np.ndarray  # float32 [N, channels, length]
    labels: list[str]  # class label of each series ("" without @classLabel)
    class_labels: list[str]  # the labels @classLabel declares, in its order


def _header_bool(value: str, path: Path, line: int, tag: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise TsFormatError(path, line, f"@{tag} must be true or false, got {value!r}")
    return value.lower() == "true"


def read_ts(path: Path) -> TsDataset:
    """Parse an equal-length `.ts` file without timestamps (what the UEA archive ships).

    Raises TsFormatError naming the file and line for anything that does not fit the header:
    a wrong number of dimensions or values, a value that is not a number, a label that
    @classLabel does not declare, `?` where `@missing false` says there is none.
    """
    path = Path(path)
    header: dict[str, str] = {}
    classes: list[str] = []
    has_labels = False
    rows: list[np.ndarray] = []
    labels: list[str] = []
    in_data = False
    number = 0
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                if not line.startswith("@"):
                    raise TsFormatError(path, number, "expected a @tag line or @data before data")
                tag, _, value = line[1:].partition(" ")
                tag, value = tag.lower(), value.strip()
                if tag == "data":
                    in_data = True
                    _check_header(header, path, number)
                elif tag == "classlabel":
                    first, *names = value.split()
                    has_labels = _header_bool(first or "", path, number, "classLabel")
                    classes = names
                else:
                    header[tag] = value
                continue
            row, label = _data_line(line, header, has_labels, classes, path, number)
            rows.append(row)
            labels.append(label)
    if not in_data:
        raise TsFormatError(path, number, "no @data line")
    if not rows:
        raise TsFormatError(path, number, "no series after @data")
    return TsDataset(header.get("problemname", path.stem), np.stack(rows), labels, classes)


def _check_header(header: dict[str, str], path: Path, line: int) -> None:
    if _header_bool(header.get("timestamps", "false"), path, line, "timeStamps"):
        raise TsFormatError(path, line, "series with timestamps are not supported")
    if not _header_bool(header.get("equallength", "true"), path, line, "equalLength"):
        raise TsFormatError(path, line, "series of unequal length are not supported")


def _data_line(
    line: str,
    header: dict[str, str],
    has_labels: bool,
    classes: list[str],
    path: Path,
    number: int,
) -> tuple[np.ndarray, str]:
    fields = line.split(":")
    label = ""
    if has_labels:
        label = fields.pop().strip()
        if classes and label not in classes:
            raise TsFormatError(path, number, f"class {label!r} is not one of {classes}")
    dimensions = int(header.get("dimensions", len(fields)))
    if len(fields) != dimensions:
        raise TsFormatError(path, number, f"{len(fields)} dimensions, the header says {dimensions}")
    missing_ok = _header_bool(header.get("missing", "false"), path, number, "missing")
    channels = []
    for d, text in enumerate(fields):
        values = []
        for cell in text.split(","):
            cell = cell.strip()
            if cell == "?" and missing_ok:
                values.append(math.nan)
                continue
            try:
                values.append(float(cell))
            except ValueError:
                raise TsFormatError(
                    path, number, f"dimension {d}: {cell!r} is not a number"
                ) from None
        channels.append(values)
    length = int(header.get("serieslength", len(channels[0])))
    lengths = sorted({len(c) for c in channels})
    if lengths != [length]:
        raise TsFormatError(path, number, f"series of length {lengths}, the header says {length}")
    return np.asarray(channels, dtype=np.float32), label


def basic_motions_files() -> tuple[Path, Path]:
    """The TRAIN and TEST `.ts` files of BasicMotions inside the installed sktime package,
    found without importing it."""
    spec = importlib.util.find_spec(SERIES_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {SERIES_PACKAGE} package is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / BASIC_MOTIONS
    files = folder / "BasicMotions_TRAIN.ts", folder / "BasicMotions_TEST.ts"
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing from the installed {SERIES_PACKAGE}")
    return files


def series_caption(key: str, label: str) -> str:
    """The caption of recording `key` of class `label`, e.g. "someone playing badminton"."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return CAPTION_TEMPLATES[digest[0] % len(CAPTION_TEMPLATES)].format(ACTIVITIES[label])


__all__ = [
    "ACTIVITIES",
    "CAPTION_TEMPLATES",
    "SERIES_PACKAGE",
    "ZEROSHOT_TEMPLATES",
    "TsDataset",
    "TsFormatError",
    "basic_motions_files",
    "read_ts",
    "series_caption",
]
