"""`mmtrain data build` of chat data: one conversation and its images -> one shard sample.

Runs in the build's worker processes, called by `process.process_item` for the items of a
`sources.ConversationSource`. The sample, as the VLM contract fixes it:
`{key}.json` = {"id", "messages": [{"role", "content"}], "images": ["0.jpg", ...]} (plus
"source", "image_sizes" and the build's "sha256") and the images as members `{key}.0.jpg`,
`{key}.1.png`, ... in the order of the `<image>` tags; the name keeps each image's format.

Images go the way of every image of a build: read, extension checked against the content,
decoded under the pixel bound, re-encoded only when `--image-max-side` shrinks them, else
stored as they are. A missing, empty, mislabelled or undecodable image rejects the whole
conversation (kind and reason in rejects.jsonl): its `<image>` tag would have nothing to show.

Filters: exact duplicates (`--dedup`) hash the conversation's text and image bytes, so the same
image with another question is kept. Resolution and blur filters look at the weakest image (the
smallest shorter side; the lowest sharpness). Near duplicates (pHash), caption length,
relevance and `--fix-text` do not apply and their flags are refused (`options.CHAT_IGNORED`:
several conversations about one image are not duplicates, a chat is no caption, and chat
templates are whitespace-sensitive, so text is kept exactly as written).
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
from mmtrain.data.ingest.sources import EXTENSION_MODALITY, ConversationItem, Item, Part
from mmtrain.data.stream.media import MediaError, check_extension, decode_image

__all__ = ["process_conversation"]


class _Rejected(Exception):
    """(kind, path, reason) of a rejected conversation."""

    def __init__(self, kind: str, path: str, reason: str):
        super().__init__(reason)
        self.reject = (kind, path, reason)


def process_conversation(item: Item, opts: ProcessOptions) -> Outcome:
    """The sample and filter features of a conversation item, or its reject."""
    assert item.conversation is not None
    conv = item.conversation.conversation
    try:
        raw = _read_images(item.conversation)
        messages = [{"role": turn.role, "content": turn.text} for turn in conv.turns]
        text = json_bytes({"messages": messages})
        features = Features(sha256=content_sha256([("messages", text), *_numbered(raw)]))
        members, sizes = {}, []
        for n, (part, data) in enumerate(zip(item.conversation.images, raw, strict=True)):
            name, stored, size = _image(n, part, data, opts, features)
            members[name] = stored
            sizes.append(size)
    except _Rejected as err:
        kind, path, reason = err.reject
        return Outcome(item.index, item.origin, reject=(kind, path, f"{item.origin}: {reason}"))
    meta = {
        "id": conv.key,
        "messages": messages,
        "images": list(members),
        "image_sizes": sizes,
        "source": item.origin,
    }
    sample = {"__key__": sample_key(item.index), **members, "json": json_bytes(meta)}
    return Outcome(item.index, item.origin, [sample], features)


def _numbered(raw: list[bytes]) -> list[tuple[str, bytes]]:
    return [(f"image{n}", data) for n, data in enumerate(raw)]


def _read_images(conversation: ConversationItem) -> list[bytes]:
    total = len(conversation.images)
    out = []
    for n, part in enumerate(conversation.images):
        which = f"image {n + 1} of {total}"
        if EXTENSION_MODALITY.get(part.ext) != "image":
            raise _Rejected(
                "not_an_image", part.origin, f"{which}: extension {part.ext!r} is no image format"
            )
        try:
            data = part.read()
        except FileNotFoundError:
            raise _Rejected(
                "missing_image", part.origin, f"{which}: no such file (check --image-root)"
            ) from None
        except OSError as err:
            raise _Rejected("unreadable", part.origin, f"{which}: {err.strerror or err}") from None
        if not data:
            raise _Rejected("empty", part.origin, f"{which}: empty file (0 bytes)")
        out.append(data)
    return out


def _image(
    n: int, part: Part, data: bytes, opts: ProcessOptions, features: Features
) -> tuple[str, bytes, list[int]]:
    """(member name, bytes to store, [width, height]); the weakest image's measurements go
    into `features`."""
    reject = partial(_Rejected, path=part.origin)
    try:
        check_extension(part.ext, data)
    except MediaError as err:
        raise reject("mislabelled", reason=f"image {n + 1}: {err}") from None
    try:
        pixels = decode_image(data, max_pixels=opts.max_pixels)
    except MediaError as err:
        raise reject("undecodable", reason=f"image {n + 1}: {err}") from None
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
