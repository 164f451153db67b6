"""Shards in object storage: `s3://bucket/prefix/...` URLs, listing, downloads and uploads.

The S3 API over HTTP through boto3. The endpoint and the credentials come from the standard AWS
environment and config files only (`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`,
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `~/.aws/config`), so MinIO, Ceph
RGW, SeaweedFS and the cloud providers work alike and nothing here invents its own variables.

Retries are ours, not botocore's: a connection refused while sending a request and a connection
reset half way through an object's body look different to botocore (it only retries the first),
and a download that arrives with the wrong size or sha256 must be fetched again too. So botocore
makes one attempt per call and `_retrying` makes up to `max_attempts` (AWS_MAX_ATTEMPTS or the
profile's `max_attempts`; default 5) with exponential backoff, then raises `RemoteError` naming
the object and the endpoint. Missing objects and refused credentials fail at once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from mmtrain.data.storage.manifest import MANIFEST_NAME, parse_manifest
from mmtrain.data.storage.shard_lists import expand_braces

logger = logging.getLogger(__name__)

SCHEME = "s3://"
DEFAULT_MAX_ATTEMPTS = 5
BACKOFF_FIRST_S = 0.5  # first wait; doubles per attempt
BACKOFF_MAX_S = 20.0
CHUNK_BYTES = 1 << 20

# S3 error codes that a retry can cure (the server is busy or restarting).
_TRANSIENT_CODES = frozenset(
    {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
     "RequestTimeout", "RequestTimeTooSkewed", "Throttling", "ThrottlingException"}
)  # fmt: skip
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})

__all__ = [
    "RemoteError",
    "CorruptDownload",
    "DownloadStopped",
    "RemoteObject",
    "S3Store",
    "is_remote",
    "split_url",
    "join_url",
    "list_shards",
    "Uploader",
    "staging_dir",
]

T = TypeVar("T")


class RemoteError(OSError):
    """Object storage failed for one object after the retries (the message names it and the
    endpoint)."""


class DownloadStopped(Exception):
    """The caller asked a download to stop (a prefetch that is no longer wanted)."""


class CorruptDownload(ValueError):
    """A downloaded object does not have the size or sha256 its listing or manifest promised."""


@dataclass(frozen=True)
class RemoteObject:
    """One object: its URL, size, and what a download is checked against."""

    url: str
    bytes: int
    sha256: str | None = None  # from the manifest, when there is one
    etag: str = ""  # changes when the object is replaced: keys the cached index

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


def is_remote(spec: Any) -> bool:
    """True when `spec` (a shard spec, or a list of them) names anything in object storage."""
    if isinstance(spec, (list, tuple)):
        return any(is_remote(item) for item in spec)
    return isinstance(spec, str) and spec.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`; ValueError naming the URL when it is not one."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r}: no bucket name after s3://")
    if any(part == ".." for part in key.split("/")):
        raise ValueError(f"{url!r}: '..' is not allowed in an object key")
    return bucket, key


def join_url(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _transient(err: Exception) -> bool:
    """Whether trying again can help: network trouble, a busy server, a corrupt download."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if isinstance(err, CorruptDownload):
        return True
    if isinstance(err, ClientError):
        return _error_code(err) in _TRANSIENT_CODES
    # Connection refused/reset/closed, timeouts, a body cut short. Missing credentials or a bad
    # parameter (other BotoCoreErrors) will not get better by waiting.
    return isinstance(err, (ConnectionError, HTTPClientError, IncompleteReadError, OSError))


class S3Store:
    """A boto3 S3 client made from the standard AWS configuration, with retries and clear errors.

    Picklable (DataLoader workers get a copy): the client is made on first use in each process.
    """

    def __init__(self) -> None:
        self._client: Any = None
        self._attempts: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_client": None, "_attempts": self._attempts}

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            import botocore.config
            import botocore.session

            session = botocore.session.get_session()
            attempts = session.get_config_variable("max_attempts")
            self._attempts = int(attempts) if attempts else DEFAULT_MAX_ATTEMPTS
            # One attempt per call: `_retrying` owns the retries (see the module docstring).
            config = botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"})
            self._client = boto3.session.Session(botocore_session=session).client(
                "s3", config=config
            )
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    @property
    def max_attempts(self) -> int:
        _ = self.client
        return int(self._attempts or DEFAULT_MAX_ATTEMPTS)

    def _retrying(self, what: str, url: str, call: Callable[[], T]) -> T:
        """`call()`, tried again after transient failures with exponential backoff."""
        attempts = self.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except DownloadStopped:
                raise
            except Exception as err:  # classified below: transient or not
                code = _error_code(err)
                if code in _MISSING_CODES:
                    raise FileNotFoundError(f"{url}: no such object at {self.endpoint}") from None
                if not _transient(err):
                    raise RemoteError(
                        f"{what} {url} at {self.endpoint} failed: {err} (check the credentials "
                        "and the bucket: AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_ENDPOINT_URL)"
                    ) from err
                if attempt == attempts:
                    raise RemoteError(
                        f"{what} {url} at {self.endpoint} failed {attempts} times, last: {err} "
                        "(is the storage server up? AWS_MAX_ATTEMPTS sets the number of tries)"
                    ) from err
                wait = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
                logger.warning(
                    "%s %s at %s: %s; attempt %d of %d, next in %.1f s",
                    what, url, self.endpoint, err, attempt, attempts, wait,
                )  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ reading
    def list_folder(self, folder_url: str) -> dict[str, RemoteObject]:
        """Objects directly inside `folder_url` (not in sub-folders), by file name."""
        bucket, prefix = split_url(folder_url.rstrip("/") + "/")
        prefix = prefix if prefix != "/" else ""

        def listing() -> dict[str, RemoteObject]:
            found = {}
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(prefix) :]
                    url = f"{SCHEME}{bucket}/{item['Key']}"
                    found[name] = RemoteObject(url, int(item["Size"]), None, item["ETag"])
            return found

        return self._retrying("listing", folder_url, listing)

    def read_bytes(self, url: str) -> bytes:
        """A small object (a manifest) in memory."""
        bucket, key = split_url(url)
        return self._retrying(
            "reading", url, lambda: self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        )

    def download(
        self, obj: RemoteObject, dest: Path, stop: Callable[[], bool] | None = None
    ) -> int:
        """Write `obj` into `dest` (a temporary name the caller renames), check its size and
        sha256 (when known), fsync it; retried as a whole. Returns the attempts it took."""
        bucket, key = split_url(obj.url)
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            digest = hashlib.sha256()
            written = 0
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                with open(dest, "wb") as f:
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        if stop is not None and stop():
                            raise DownloadStopped(obj.url)
                        digest.update(chunk)
                        written += len(chunk)
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                body.close()
            _check_download(obj, written, digest.hexdigest())

        self._retrying("downloading", obj.url, attempt)
        return tries

    # ------------------------------------------------------------------ writing
    def upload_file(self, path: Path, url: str, sha256: str) -> None:
        """Upload one file; an S3 object appears whole or not at all, so no temporary name."""
        bucket, key = split_url(url)
        extra = {"Metadata": {"sha256": sha256}}
        self._retrying(
            "uploading",
            url,
            lambda: self.client.upload_file(str(path), bucket, key, ExtraArgs=extra),
        )

    def put_bytes(self, url: str, data: bytes) -> None:
        bucket, key = split_url(url)
        self._retrying(
            "uploading", url, lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data)
        )

    def head(self, url: str) -> RemoteObject | None:
        """Size, sha256 (from the metadata our uploads write) and ETag; None when missing."""
        bucket, key = split_url(url)
        try:
            meta = self._retrying(
                "checking", url, lambda: self.client.head_object(Bucket=bucket, Key=key)
            )
        except FileNotFoundError:
            return None
        sha = meta.get("Metadata", {}).get("sha256")
        return RemoteObject(url, int(meta["ContentLength"]), sha, meta.get("ETag", ""))


def _check_download(obj: RemoteObject, written: int, sha256: str) -> None:
    if written != obj.bytes:
        raise CorruptDownload(f"{obj.url}: got {written} bytes, expected {obj.bytes}")
    if obj.sha256 is not None and sha256 != obj.sha256:
        raise CorruptDownload(f"{obj.url}: sha256 {sha256[:12]}... differs from the manifest")


# ----------------------------------------------------------------------------- shard lists
def list_shards(spec: str, store: S3Store) -> tuple[list[RemoteObject], dict[str, Any] | None]:
    """The shards an s3:// spec names, in order, and the manifest of their folder (or None).

    `spec` is a folder (`s3://b/p/` or `s3://b/p`: the shards its manifest lists, else its
    `*.tar` objects by name), a brace pattern, a glob on file names, or one object. Sizes come
    from one listing per folder; sha256 from the folder's `manifest.json` when there is one.
    FileNotFoundError names the first missing shard.
    """
    split_url(spec)  # a clear error for a malformed URL
    name = spec.rstrip("/").rsplit("/", 1)[-1]
    is_folder = spec.endswith("/") or not (
        "." in name or "{" in spec or any(ch in name for ch in "*?[")
    )
    if is_folder:
        folder = spec.rstrip("/")
        listing = store.list_folder(folder)
        manifest = _manifest(folder, listing, store)
        if manifest is not None:
            names = [s["name"] for s in manifest["shards"]]
        else:
            names = sorted(n for n in listing if n.endswith(".tar"))
        if not names:
            raise FileNotFoundError(f"{spec}: no shards (*.tar) in this folder")
        return _resolve([join_url(folder, n) for n in names], {folder: listing}, manifest), manifest
    urls = expand_braces(spec) if "{" in spec else [spec]
    folders = {u.rsplit("/", 1)[0] for u in urls}
    listings = {folder: store.list_folder(folder) for folder in sorted(folders)}
    if any(ch in name for ch in "*?[") and "{" not in spec:
        folder = spec.rsplit("/", 1)[0]
        urls = [join_url(folder, n) for n in sorted(listings[folder]) if fnmatch.fnmatch(n, name)]
        if not urls:
            raise FileNotFoundError(f"{spec}: no object matches this pattern")
    manifest = None
    if len(folders) == 1:
        folder = next(iter(folders))
        manifest = _manifest(folder, listings[folder], store)
    return _resolve(urls, listings, manifest), manifest


def _manifest(
    folder: str, listing: dict[str, RemoteObject], store: S3Store
) -> dict[str, Any] | None:
    if MANIFEST_NAME not in listing:
        return None
    url = join_url(folder, MANIFEST_NAME)
    text = store.read_bytes(url).decode("utf-8", "replace")
    return parse_manifest(text, url)


def _resolve(
    urls: Sequence[str],
    listings: dict[str, dict[str, RemoteObject]],
    manifest: dict[str, Any] | None,
) -> list[RemoteObject]:
    listed = {s["name"]: s for s in (manifest or {}).get("shards", [])}
    objects = []
    for url in urls:
        folder, name = url.rsplit("/", 1)
        found = listings.get(folder, {}).get(name)
        if found is None:
            raise FileNotFoundError(f"shard not found: {url}")
        entry = listed.get(name)
        if entry is not None:  # the manifest is the promise a download is checked against
            found = RemoteObject(url, int(entry["bytes"]), entry["sha256"], found.etag)
        objects.append(found)
    return objects


def local_name(url: str) -> PurePosixPath:
    """`bucket/key` of a URL as a relative path (for mirroring objects in a local folder)."""
    bucket, key = split_url(url)
    return PurePosixPath(bucket, *[p for p in key.split("/") if p not in ("", ".")])


# ----------------------------------------------------------------------------- uploads
class Uploader:
    """Publishes a build from its local folder to `s3://bucket/prefix/`: each shard when it is
    complete, the manifest last and only once every shard it names is there, so a reader never
    sees a manifest naming a missing shard. S3 objects appear whole, so no temporary names."""

    def __init__(self, url: str, local_dir: Path, store: S3Store | None = None):
        split_url(url)
        self.url = url.rstrip("/")
        self.local_dir = Path(local_dir)
        self.store = store if store is not None else S3Store()
        self._present: dict[str, str] = {}  # name -> sha256 confirmed on the server

    def refuse_foreign(self) -> None:
        """A new build must not mix its shards with ones it did not write."""
        listing = self.store.list_folder(self.url)
        foreign = sorted(n for n in listing if n.endswith(".tar") or n == MANIFEST_NAME)
        if foreign:
            raise FileExistsError(
                f"{self.url}/ already holds {foreign[0]} that this build did not write (no "
                f"build journal in {self.local_dir}); use an empty prefix"
            )

    def shard(self, entry: dict[str, Any]) -> None:
        """Upload one finished shard (skipped when the server has it with this sha256)."""
        name, sha256 = entry["name"], entry["sha256"]
        if self._present.get(name) == sha256:
            return
        url = join_url(self.url, name)
        there = self.store.head(url)
        if there is None or there.bytes != entry["bytes"] or there.sha256 != sha256:
            self.store.upload_file(self.local_dir / name, url, sha256)
            logger.info("uploaded %s", url)
        self._present[name] = sha256

    def manifest(self, shards: Sequence[dict[str, Any]]) -> str:
        """Upload the local manifest after making sure every shard it names is uploaded."""
        for entry in shards:
            self.shard(entry)
        url = join_url(self.url, MANIFEST_NAME)
        self.store.put_bytes(url, (self.local_dir / MANIFEST_NAME).read_bytes())
        return url


def staging_dir(url: str, cache_root: Path) -> Path:
    """Where `data build --out s3://...` builds before uploading (kept: a rerun resumes)."""
    return cache_root / "build" / local_name(url.rstrip("/"))
