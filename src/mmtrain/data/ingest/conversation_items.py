"""`mmtrain data build` of chat data: one conversation, its images and videos -> one sample.

Runs in the build's worker processes, called by `process.process_item` for the items of a
`sources.ConversationSource`. The sample, as the VLM contract fixes it:
`{key}.json` = {"id", "messages": [{"role", "content"}], "images": ["0.jpg", ...],
"chosen" and "rejected" (a preference pair's answers; `messages` its prompt),
"videos": ["v0.mp4", ...]} (plus "source", "image_sizes" ([width, height] per image),
"video_sizes" ([frames, width, height, fps] per video) and the build's "sha256"), the images
as members `{key}.0.jpg`, `{key}.1.png`, ... in the order of the `<image>` tags and the videos
as members `{key}.v0.mp4`, `{key}.v1.webm`, ... in the order of the `<video>` tags; the name
keeps each file's format. "images" and "videos" are always there (empty lists when none).

Images go the way of every image of a build: read, extension checked against the content,
decoded under the pixel bound, re-encoded only when `--image-max-side` shrinks them, else
stored as they are. Videos are read, their extension checked against the content and their
header read under the same pixel bound (`media.video_header`: frames, size, frame rate), and
always stored as they are, never re-encoded or cut (the loader samples their frames). A
missing, empty, mislabelled or undecodable image or video rejects the whole conversation (kind
and reason in rejects.jsonl): its `<image>` or `<video>` tag would have nothing to show.

Filters: exact duplicates (`--dedup`) hash the conversation's text, image and video bytes, so
the same image with another question is kept. Resolution and blur filters look at the weakest
image (the smallest shorter side; the lowest sharpness), the short-video filter at the
shortest video (frames / fps of its header); videos are never cut or scaled. Near
duplicates (pHash), caption length, relevance and `--fix-text` do not apply and their flags are
refused (`options.CHAT_IGNORED`: several conversations about one image are not duplicates, a
chat is no caption, and chat templates are whitespace-sensitive, so text is kept exactly as
written).
"""

from __future__ import annotations

from functools import partial

from mmtrain.data.ingest.filters import Features, content_sha256, laplacian_variance
from mmtrain.data.ingest.outcome import (
    Outcome,
    ProcessOptions,
    json_bytes,
    reencode_image,
    sample_key,
)
from mmtrain.data.ingest.sources import EXTENSION_MODALITY, Item, Part
from mmtrain.data.stream.media import MediaError, check_extension, decode_image, video_header

__all__ = ["process_conversation"]

# Per modality: (reject kind of a file of another extension, reject kind of a missing file).
_KINDS = {"image": ("not_an_image", "missing_image"), "video": ("not_a_video", "missing_video")}


class _Rejected(Exception):
    """(kind, path, reason) of a rejected conversation."""

    def __init__(self, kind: str, path: str, reason: str):
        super().__init__(reason)
        self.reject = (kind, path, reason)


def process_conversation(item: Item, opts: ProcessOptions) -> Outcome:
    """The sample and filter features of a conversation item, or its reject."""
    assert item.conversation is not None
    conv = item.conversation.conversation
    images, videos = item.conversation.images, item.conversation.videos
    try:
        raw_images = _read_files(images, "image")
        raw_videos = _read_files(videos, "video")
        messages = [{"role": turn.role, "content": turn.text} for turn in conv.turns]
        pair = {"chosen": conv.chosen, "rejected": conv.rejected} if conv.is_preference() else {}
        text = json_bytes({"messages": messages, **pair})
        numbered = [*_numbered("image", raw_images), *_numbered("video", raw_videos)]
        features = Features(sha256=content_sha256([("messages", text), *numbered]))
        image_members, image_sizes = {}, []
        for n, (part, data) in enumerate(zip(images, raw_images, strict=True)):
            name, stored, size = _image(n, len(images), part, data, opts, features)
            image_members[name] = stored
            image_sizes.append(size)
        video_members, video_sizes = {}, []
        for n, (part, data) in enumerate(zip(videos, raw_videos, strict=True)):
            name, size = _video(n, len(videos), part, data, opts)
            video_members[name] = data
            video_sizes.append(size)
            seconds = size[0] / size[3]
            if features.video_s is None or seconds < features.video_s:
                features.video_s = seconds  # the short-video filter sees the shortest video
    except _Rejected as err:
        kind, path, reason = err.reject
        return Outcome(item.index, item.origin, reject=(kind, path, f"{item.origin}: {reason}"))
    meta = {
        "id": conv.key,
        "messages": messages,
        **pair,
        "images": list(image_members),
        "image_sizes": image_sizes,
        "videos": list(video_members),
        "video_sizes": video_sizes,
        "source": item.origin,
    }
    members = {**image_members, **video_members}
    sample = {"__key__": sample_key(item.index), **members, "json": json_bytes(meta)}
    return Outcome(item.index, item.origin, [sample], features)


def _numbered(modality: str, raw: list[bytes]) -> list[tuple[str, bytes]]:
    return [(f"{modality}{n}", data) for n, data in enumerate(raw)]


def _read_files(parts: tuple[Part, ...], modality: str) -> list[bytes]:
    """The bytes of a conversation's image (or video) files, in tag order."""
    wrong_ext, missing = _KINDS[modality]
    out = []
    for n, part in enumerate(parts):
        which = f"{modality} {n + 1} of {len(parts)}"
        if EXTENSION_MODALITY.get(part.ext) != modality:
            raise _Rejected(
                wrong_ext,
                part.origin,
                f"{which}: extension {part.ext!r} is no {modality} format",
            )
        try:
            data = part.read()
        except FileNotFoundError:
            raise _Rejected(
                missing, part.origin, f"{which}: no such file (check --image-root)"
            ) from None
        except OSError as err:
            raise _Rejected("unreadable", part.origin, f"{which}: {err.strerror or err}") from None
        if not data:
            raise _Rejected("empty", part.origin, f"{which}: empty file (0 bytes)")
        out.append(data)
    return out


def _check_content(part: Part, data: bytes, which: str) -> None:
    """The content must be what the extension says (a JPEG named .mp4 is mislabelled)."""
    try:
        check_extension(part.ext, data)
    except MediaError as err:
        raise _Rejected("mislabelled", part.origin, f"{which}: {err}") from None


def _image(
    n: int, total: int, part: Part, data: bytes, opts: ProcessOptions, features: Features
) -> tuple[str, bytes, list[int]]:
    """(member name, bytes to store, [width, height]); the weakest image's measurements go
    into `features`."""
    reject = partial(_Rejected, path=part.origin)
    which = f"image {n + 1} of {total}"
    _check_content(part, data, which)
    try:
        pixels = decode_image(data, max_pixels=opts.max_pixels)
    except MediaError as err:
        raise reject("undecodable", reason=f"{which}: {err}") from None
    height, width = pixels.shape[:2]
    if features.height is None or min(height, width) < min(
        features.height, features.width or height
    ):
        features.height, features.width = height, width
    if opts.sharpness:
        sharpness = laplacian_variance(pixels)
        if features.sharpness is None or sharpness < features.sharpness:
            features.sharpness = sharpness
    ext = "jpg" if part.ext == "jpeg" else part.ext
    if opts.image_max_side and max(height, width) > opts.image_max_side:
        data, (width, height) = reencode_image(pixels, ext, opts.image_max_side)
    return f"{n}.{ext}", data, [width, height]


def _video(
    n: int, total: int, part: Part, data: bytes, opts: ProcessOptions
) -> tuple[str, list[int | float]]:
    """(member name, [frames, width, height, fps]) of a video stored as it is."""
    reject = partial(_Rejected, path=part.origin)
    which = f"video {n + 1} of {total}"
    _check_content(part, data, which)
    try:
        frames, height, width, fps = video_header(data, max_pixels=opts.max_pixels)
    except MediaError as err:
        raise reject("undecodable", reason=f"{which}: {err}") from None
    if frames < 1:
        raise reject("undecodable", reason=f"{which}: no video frames")
    return f"v{n}.{part.ext}", [frames, width, height, fps]
