"""Where a run's checkpoints live: a local folder or an fsspec URL (``s3://bucket/prefix``).

Plain paths (and ``file://`` URLs) are written as before: temp file, fsync, rename, so a
crash leaves the old or the new file. Any other URL goes through fsspec; an object store
writes each object whole (an S3 PUT is atomic), so no temp name is needed. S3 takes its
endpoint and keys from the standard variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``), which Ray actors inherit from the driver.
Everything here moves bytes (safetensors, JSON); nothing is pickled.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from distbelief.errors import UserError

__all__ = ["basename", "check_writable", "download_events", "exists", "is_url", "join", "listdir",
           "local_mirror", "local_path", "makedirs", "read_bytes", "remove", "upload_folder",
           "write_bytes"]


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` is a URL of a remote file system (``file://`` counts as local)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def local_path(location: str | os.PathLike) -> Path:
    """A local location as a path (``file:///x`` -> ``/x``)."""
    text = str(location)
    return Path(text[len("file://"):]) if text.startswith("file://") else Path(text)


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base`` / ``parts`` (a URL keeps its scheme; a path stays a path)."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(local_path(base).joinpath(*parts))


def basename(location: str | os.PathLike) -> str:
    """The last component of a path or URL."""
    return str(location).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _fs(url: str):
    """The fsspec file system of ``url`` and the path inside it; one-line
    :class:`UserError` when the scheme is unknown or its library is not installed."""
    import fsspec

    scheme = url.split("://", 1)[0]
    options = {}
    if scheme in ("s3", "s3a"):
        options["use_listings_cache"] = False
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as err:
        extra = "s3" if scheme in ("s3", "s3a") else scheme
        raise UserError(f"{url}: the {scheme}:// file system needs a library that is not "
                        f"installed ({err}): pip install 'distbelief[{extra}]'") from None
    except ValueError as err:
        raise UserError(f"{url}: {err}: use a plain path or an fsspec URL such as "
                        "s3://bucket/prefix") from None


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` as the whole file at ``location``, atomically."""
    if is_url(location):
        fs, path = _fs(str(location))
        fs.pipe_file(path, data)
        return
    path = local_path(location)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_bytes(location: str | os.PathLike) -> bytes:
    """The whole file at ``location``; ``FileNotFoundError`` if there is none."""
    if is_url(location):
        fs, path = _fs(str(location))
        return fs.cat_file(path)
    return local_path(location).read_bytes()


def exists(location: str | os.PathLike) -> bool:
    if is_url(location):
        fs, path = _fs(str(location))
        return fs.exists(path)
    return local_path(location).is_file()


def listdir(location: str | os.PathLike) -> list[str]:
    """The names (not paths) of the files directly in folder ``location``, sorted; none if
    it does not exist."""
    if is_url(location):
        fs, path = _fs(str(location))
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1]
                          for p in fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
    folder = local_path(location)
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def remove(location: str | os.PathLike) -> None:
    """Delete the file at ``location`` if it exists."""
    if is_url(location):
        fs, path = _fs(str(location))
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        return
    local_path(location).unlink(missing_ok=True)


def makedirs(location: str | os.PathLike) -> None:
    """Create folder ``location`` (an object store needs none)."""
    if not is_url(location):
        local_path(location).mkdir(parents=True, exist_ok=True)


def check_writable(url: str) -> None:
    """Write, read back and delete a probe object under ``url``; one-line :class:`UserError`
    (before anything starts) when the library is missing or the store is unreachable or
    refuses the write."""
    probe = join(url, f".distbelief-probe-{uuid.uuid4().hex[:8]}")
    try:
        write_bytes(probe, b"ok")
        if read_bytes(probe) != b"ok":
            raise OSError("the probe object read back differently")
        remove(probe)
    except UserError:
        raise
    except Exception as err:  # botocore/aiohttp errors are not OSErrors
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"--run-dir {url} cannot be written ({type(err).__name__}: {first}): "
                        "check the bucket exists, the endpoint (AWS_ENDPOINT_URL) and the "
                        "keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from None


def local_mirror(url: str) -> Path:
    """The local folder that mirrors a remote run folder's metrics, events and plot:
    ``runs/mirror/SCHEME/BUCKET/PREFIX``."""
    scheme, rest = url.split("://", 1)
    return Path("runs") / "mirror" / scheme / rest.strip("/")


def download_events(url: str, folder: Path) -> None:
    """Copy ``url``'s ``metrics.jsonl`` into a local mirror ``folder`` that has none yet (a
    run resumed on another machine appends to its events)."""
    target = Path(folder) / "metrics.jsonl"
    if target.exists():
        return
    try:
        data = read_bytes(join(url, "metrics.jsonl"))
    except FileNotFoundError:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def upload_folder(folder: Path, url: str) -> None:
    """Copy the files directly in local ``folder`` to ``url`` (each file whole)."""
    for path in sorted(Path(folder).iterdir()):
        if path.is_file():
            write_bytes(join(url, path.name), path.read_bytes())
