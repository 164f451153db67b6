"""`mmtrain data inspect`: report, --verify (corrupt samples), damage, unsafe members, contact sheet."""

import io
import json
import tarfile

import av
import numpy as np
import soundfile
from PIL import Image

from mmtrain.cli import main
from mmtrain.data.ingest.inspect import contact_sheet, inspect_shards, spectrogram_tile
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet

RED, BLUE = (230, 20, 20), (20, 40, 230)


def solid_jpeg(colour, size=(96, 64)):
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG", quality=95)
    return out.getvalue()


def mp4_clip(frames=6, colour=BLUE):
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            pixels = np.empty((48, 64, 3), np.uint8)
            pixels[:] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def wav_tone(seconds=0.5, rate=8000):
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return out.getvalue()


def make_dataset(folder, broken=False):
    """Images, a video, audio and captions; with `broken`, three bad members among them."""
    good_jpeg = solid_jpeg(RED)
    samples = [
        {"__key__": f"img{i}", "jpg": good_jpeg, "txt": f"red picture {i}", "json": '{"i": 1}'}
        for i in range(5)
    ]
    samples.append({"__key__": "clip", "mp4": mp4_clip(), "txt": "a blue clip"})
    samples.append({"__key__": "tone", "wav": wav_tone(), "txt": "a tone"})
    if broken:
        samples[1]["jpg"] = good_jpeg[: len(good_jpeg) // 2]  # truncated
        samples[3]["jpg"] = wav_tone()  # mislabelled: audio bytes named .jpg
        samples[4]["txt"] = b"caf\xe9 \xff"  # not UTF-8
    with ShardWriter(folder, max_samples=4) as writer:
        for sample in samples:
            writer.write(sample)
    write_manifest(
        folder,
        writer.shards,
        modalities=["image", "text"],
        filters={"duplicates": {"dropped": 2}},
        command="mmtrain data build src --out data",
    )


def test_report_of_a_clean_dataset(tmp_path, capsys):
    make_dataset(tmp_path)
    assert main(["data", "inspect", str(tmp_path), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["samples"] for s in report["shards"]] == [4, 3] and report["samples"] == 7
    assert report["modalities"] == {"image": 5, "text": 7, "video": 1, "audio": 1}
    assert report["corrupt"] == [] and report["decoded"] == 7 and report["problems"] == []
    assert report["filters"] == {"duplicates": {"dropped": 2}}
    assert report["bytes"] == sum((tmp_path / s["name"]).stat().st_size for s in report["shards"])
    assert main(["data", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "7 samples" in out and "filter      duplicates" in out and "built by" in out


def test_verify_lists_corrupt_samples_and_exits_1(tmp_path, capsys):
    make_dataset(tmp_path, broken=True)
    # Without --verify only the structure is checked: the shards match their manifest.
    assert main(["data", "inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["corrupt"] == []
    assert main(["data", "inspect", str(tmp_path), "--verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    corrupt = {(c["key"], c["member"]): c for c in report["corrupt"]}
    assert set(corrupt) == {("img1", "jpg"), ("img3", "jpg"), ("img4", "txt")}
    assert corrupt[("img1", "jpg")]["shard"] == "shard-000000.tar"
    assert "truncated" in corrupt[("img1", "jpg")]["reason"].lower()
    assert "does not match the content: the bytes are wav" in corrupt[("img3", "jpg")]["reason"]
    assert "not valid UTF-8" in corrupt[("img4", "txt")]["reason"]
    assert report["corrupt_samples"] == 3
    assert main(["data", "inspect", str(tmp_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "7 samples: 3 corrupt" in out and "PROBLEM     shard-000000.tar: img1.jpg" in out
    assert "manifest    2/2 shards match" in out  # the shards are intact, samples are not


def test_damaged_shards_and_unsafe_members(tmp_path, capsys):
    folder = tmp_path / "plain"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w") as tar:  # a hand-made tar, as other tools write
        for name, data in (("ok.txt", b"fine"), ("../evil.txt", b"x"), ("m.pth", b"pickle")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
    (folder / "b.tar").write_bytes(good.getvalue()[:1800])  # cut inside the third member
    report = inspect_shards(str(folder), verify=True)
    assert {m["member"] for m in report["unsafe"]} == {"../evil.txt", "m.pth"}
    assert report["damaged"] and report["damaged"][0]["shard"] == "b.tar"
    assert report["samples"] == 2  # ok, s0 (s1 is dropped: its sample may go on past the cut)
    assert main(["data", "inspect", str(folder / "*.tar")]) == 1
    out = capsys.readouterr().out
    assert "refused     2 member(s)" in out and "b.tar: damaged at byte" in out


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    make_dataset(tmp_path / "d")
    assert main(["data", "inspect", str(tmp_path / "d"), "--contact-sheet", "x.jpg"]) == 2
    assert "must end in .png" in capsys.readouterr().err
    sheet = str(tmp_path / "no" / "such" / "sheet.png")
    assert main(["data", "inspect", str(tmp_path / "d"), "--contact-sheet", sheet]) == 2


def test_contact_sheet_shows_samples_with_their_keys(tmp_path, capsys):
    make_dataset(tmp_path / "d")
    sheet = tmp_path / "sheet.png"
    argv = ["data", "inspect", str(tmp_path / "d"), "--json", "--contact-sheet", str(sheet)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["contact_sheet"]["keys"] == ["img0", "img1", "img2", "img3", "img4", "clip", "tone"]  # fmt: skip
    image = np.asarray(Image.open(sheet).convert("RGB")).astype(int)
    # 7 tiles of 160 px in a 3-column grid; tile n sits at pad + column * (tile + pad).
    assert image.shape == (3 * (160 + 18 + 6) + 6, 3 * 166 + 6, 3)

    def centre(n):
        x, y = 6 + (n % 3) * 166 + 80, 6 + (n // 3) * 184 + 80
        return image[y, x]

    assert np.abs(centre(0) - RED).max() < 20  # the image itself
    assert np.abs(centre(5) - BLUE).max() < 30  # the video's middle frame
    tone = image[6 + 2 * 184 : 6 + 2 * 184 + 160, 6 : 6 + 160]
    assert tone.std() > 10  # a spectrogram, not a blank tile
    # Keys are drawn under the tiles: the label strip is not empty.
    assert image[6 + 160 + 2 : 6 + 160 + 14, 6 : 6 + 160].max() > 200


def test_contact_sheet_marks_undecodable_samples(tmp_path):
    make_dataset(tmp_path / "d", broken=True)
    sheet = tmp_path / "sheet.png"
    keys = contact_sheet(ShardSet.open(tmp_path / "d"), sheet, count=2, tile=64)
    assert keys == ["img0", "tone"]
    keys = contact_sheet(ShardSet.open(tmp_path / "d"), sheet, count=7, tile=64, columns=7)
    image = np.asarray(Image.open(sheet).convert("RGB")).astype(int)
    frame = image[6, 6 + 70 : 6 + 70 + 64]  # top edge of tile 1 (img1, truncated)
    assert (np.abs(frame - (220, 40, 40)).max(axis=1) < 10).mean() > 0.9  # red frame


def test_spectrogram_puts_a_tone_at_its_frequency():
    rate, size = 16_000, 64
    t = np.arange(rate) / rate
    tile = np.asarray(spectrogram_tile(np.sin(2 * np.pi * 2000 * t).astype(np.float32), size))
    brightness = tile.astype(int).sum(axis=2).mean(axis=1)  # per row, top = high frequency
    row = int(np.argmax(brightness))
    assert abs(row - size * (1 - 2000 / 8000)) <= 2
