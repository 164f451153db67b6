"""A real S3 server for the tests: moto's, on 127.0.0.1, in a thread or in its own process.

`python tests/s3_server.py PORT [--exit-after-gets N]` runs one in this process until killed;
with `--exit-after-gets N` the process dies (os._exit, no response) when a client asks for a
`.tar` object the (N+1)-th time: a storage server killed at a known point of an epoch.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_endpoint(monkeypatch, endpoint: str, attempts: int = 2) -> None:
    """The standard AWS variables pointing at `endpoint` (nothing mmtrain-specific)."""
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": str(attempts),
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def client(endpoint: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def upload_folder(endpoint: str, folder: Path | str, bucket: str, prefix: str) -> str:
    """Every file of `folder` to `s3://bucket/prefix/NAME` (bucket made when missing)."""
    s3 = client(endpoint)
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3.create_bucket(Bucket=bucket)
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and not path.name.startswith("."):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}/"


class ServerProcess:
    """`python tests/s3_server.py PORT ...` in a child process (killable, restartable)."""

    def __init__(self, port: int, *args: str):
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()  # printed once the socket listens
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the S3 server on port {port} did not start: {line!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _serve(port: int, exit_after_gets: int | None) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    gets = 0

    def dying(environ, start_response):
        nonlocal gets
        if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"].endswith(".tar"):
            gets += 1
            if exit_after_gets is not None and gets > exit_after_gets:
                os._exit(3)  # killed mid-epoch: the request gets no answer
        return app(environ, start_response)

    for attempt in range(50):  # the previous server on this port may still be closing
        try:
            server = make_server(
                "127.0.0.1", port, dying, threaded=True, request_handler=MotoRequestHandler
            )
            break
        except OSError:
            if attempt == 49:
                raise
            time.sleep(0.1)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--exit-after-gets", type=int, default=None)
    args = parser.parse_args()
    _serve(args.port, args.exit_after_gets)
