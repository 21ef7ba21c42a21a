"""A real S3-compatible server (moto in server mode) on loopback, for the storage tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def s3_server(bucket: str = "runs") -> Iterator[str]:
    """Start moto's S3 server on 127.0.0.1 (a free port), point the standard variables
    (``AWS_ENDPOINT_URL``, keys, region) at it, create ``bucket``; yield the endpoint URL.
    Processes started inside (Ray nodes and workers) inherit the variables."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def objects(prefix: str, bucket: str = "runs") -> list[str]:
    """The keys under ``prefix`` in ``bucket`` of the server the variables point at."""
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    reply = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in reply.get("Contents", []))
