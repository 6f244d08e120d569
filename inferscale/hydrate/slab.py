"""Hydration: one published artifact's KV slab into host or GPU memory, verified.

:func:`hydrate` returns a :class:`~inferscale.hydrate.resident.Resident` (the slab, its
chunk index and token ids, the manifest), ready for the worker's resident store.

``hydrate`` checks the manifest (schema, self-checksum, owner), the model fingerprint
and the file size first, then reads the KV file in ONE sequential pass with the
xxh3-128 checksum fused into it (each part is hashed as it lands, so verifying costs no
second pass), refuses anything whose checksum differs, and only then parses the Arrow
file (zero-copy) and returns the slab ``[T, 2, L, H, D]`` as a view into that memory
(an fp8 slab with its scales ``[C, 2, L, H]``; a KV dtype or scale rule this reader does
not know is refused from the manifest before anything else is read).

Where the bytes go:

- tier ``"host"`` with CUDA: a pinned host buffer, filled by parallel ``preadv`` (local
  disk) or ranged parallel GETs (S3); the slab is pinned, ready for async H2D copies.
- tier ``"gpu"`` with CUDA: the same pinned buffer as staging, each part copied to the
  device on a side stream as soon as it is hashed; the pinned buffer is released after.
- no CUDA (either tier: "gpu" means CPU memory there): plain memory. On local disk
  (unless the store reads with direct I/O, ``StoreConfig.direct_io``: then the file is
  read into plain memory around the page cache, as above) the file is memory-mapped
  (private, copy-on-write: :mod:`inferscale.artifacts.mapped_file`) and the slab is a
  zero-copy view of the page cache; the hash pass is the read.

The kv file is parsed by :func:`inferscale.artifacts.kv_file.parse_kv_file`, as every
whole-slab reader does. Imports only torch, numpy, pyarrow, fsspec and xxhash (the GPU
machine has those; lancedb, s3fs are optional).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from inferscale.artifacts.blobs import Location
from inferscale.artifacts.kv_file import parse_kv_file
from inferscale.artifacts.layout import (
    KV_FILE, FingerprintMismatch, GeometryMismatch, StoreConfig, TruncatedArtifact,
)
from inferscale.artifacts.mapped_file import map_and_hash
from inferscale.artifacts.read import (
    check_digest, check_kv_format, check_size, data_path, manifest_at, resolve_version,
)
from inferscale.hydrate.arena import Region
from inferscale.hydrate.resident import Resident
from inferscale.types import KVGeometry, Tier, check_tier
from storage_schemas import kv as kv_schema
from storage_schemas.manifest import Manifest

if TYPE_CHECKING:
    from inferscale.hydrate.store import ResidentStore


def check_geometry(manifest: Manifest, geometry: KVGeometry | None) -> None:
    """:class:`GeometryMismatch` unless the version's KV (its manifest's ``kv``: the file
    itself is checked against the manifest when parsed) has ``geometry``, the serving
    model's (None: not checked)."""
    if geometry is None:
        return
    kv = manifest.kv
    got = KVGeometry(kv["layers"], kv["kv_heads"], kv["head_dim"])
    if got != KVGeometry(*geometry):
        raise GeometryMismatch(f"user {manifest.user} version {manifest.version}: its KV "
                               f"geometry {got.describe()} is not the serving model's "
                               f"{KVGeometry(*geometry).describe()}")


def slab_nbytes(manifest: Manifest, dtype: torch.dtype | None = None) -> int:
    """Bytes of the version's KV slab ``[T, 2, L, H, D]`` as stored (with its fp8 scales),
    or once converted to ``dtype`` (a float dtype: no scales), from its manifest alone
    (nothing of ``kv.arrow`` is read)."""
    check_kv_format(manifest)
    kv, tokens = manifest.kv, int(manifest.counts.get("tokens") or 0)
    stored = str(kv.get("dtype"))
    itemsize = kv_schema.ITEMSIZE[stored]
    scales = 0
    if dtype is not None and str(dtype).removeprefix("torch.") != stored:
        itemsize = dtype.itemsize
    elif stored in kv_schema.SCALES:
        scales = int(manifest.counts.get("chunks") or 0) * 2 * int(kv["layers"]) * \
            int(kv["kv_heads"]) * 4
    return tokens * 2 * int(kv["layers"]) * int(kv["kv_heads"]) * int(kv["head_dim"]) * \
        itemsize + scales


# kv.arrow reads started in this process (the worker's status reports them)
READS = {"kv_files": 0, "kv_bytes": 0}


def hydrate(store: StoreConfig, user: str, model_fp: str, version: str = "latest",
            tier: Tier = "host", device: str | torch.device | None = None,
            expected_fingerprint: str | None = None, *, geometry: KVGeometry | None = None,
            use_mmap: bool | None = None,
            part_bytes: int = 32 << 20, workers: int | None = None,
            admit: Callable[[Manifest], None] | None = None,
            staging: "ResidentStore | None" = None,
            on_part: Callable[[int], None] | None = None) -> Resident:
    """Load and verify one version's KV slab.

    ``version``: an id or ``"latest"``. ``device``: the CUDA device the slab serves
    (default: ``cuda`` when available, else ``cpu``). ``expected_fingerprint``: the
    serving model's fingerprint (default: ``model_fp``); any mismatch with the folder,
    the manifest or the kv file is :class:`FingerprintMismatch`. ``geometry``: the
    serving model's KV geometry; a version of another is :class:`GeometryMismatch`
    before any byte of ``kv.arrow`` is read (the file must then agree with its
    manifest). ``use_mmap``: default True for a local store into plain memory without
    direct I/O (see module docstring; True with ``store.direct_io`` is refused: a mapping
    is the page cache), False forces a copy.
    ``admit(manifest)``: called with the verified manifest before any byte of
    ``kv.arrow`` is read; it raises to refuse the version (the serving worker checks the
    slab's size, :func:`slab_nbytes`, against its memory budget there). Errors:
    ``ArtifactNotFound``, ``MissingManifest``, ``TruncatedArtifact``, ``ChecksumError``,
    ``FingerprintMismatch``, ``GeometryMismatch``, ``ArtifactSchemaError``,
    ``CorruptArtifact``, and what
    ``admit`` raises. ``staging``: a resident store whose staging reserve the bytes are
    read into (the serving worker: no memory is allocated, pinned or not; the returned
    resident holds that region, which ``staging.put`` adopts or gives back); otherwise
    a fresh host buffer, pinned where CUDA exists. ``on_part(nbytes)``: called after
    each part is read (a bandwidth throttle). ``part_bytes``, ``workers``: the parts
    the file is read in and how many are read at once (parallel reads, default 4 on
    local disk, 8 on S3; on the memory-mapped path, parts populated ahead of the hash):
    a background reload reads small parts one at a time, so little of its I/O is queued
    ahead of a request's reads.
    """
    check_tier(tier)
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} asked for, but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {dev}")
    expected = expected_fingerprint or model_fp
    loc = Location(store, user, model_fp)
    if expected != model_fp:
        raise FingerprintMismatch(f"the serving model is {expected}, but {loc.describe()} "
                                  f"holds artifacts of model {model_fp}")
    version = resolve_version(store, user, model_fp, version)
    manifest = manifest_at(loc, version)  # checks the fingerprint against model_fp
    check_kv_format(manifest)
    check_geometry(manifest, geometry)
    if admit is not None:
        admit(manifest)
    check_size(loc, manifest, KV_FILE)
    size = manifest.files[KV_FILE].bytes
    path = data_path(loc, manifest, KV_FILE)

    cuda = dev.type == "cuda"
    plain_local = store.is_local and not cuda
    if use_mmap is None:
        use_mmap = plain_local and not store.direct_io
    elif use_mmap and not plain_local:
        raise ValueError("use_mmap needs a local store and no CUDA device")
    elif use_mmap and store.direct_io:
        raise ValueError("use_mmap maps the page cache; the store asks for direct I/O")
    if workers is None:
        workers = 4 if store.is_local else 8

    region = staging.staging(size) if staging is not None and not use_mmap else None
    try:
        try:
            host, dev_buf, digest = _read(loc, path, size, tier, dev, use_mmap, part_bytes,
                                          workers, region, on_part)
        except FileNotFoundError as exc:  # removed between the size check and the read (gc?)
            raise TruncatedArtifact(f"{path} disappeared while being read "
                                    f"({loc.describe(version)})") from exc
        check_digest(loc, manifest, KV_FILE, digest)
        kv_file = parse_kv_file(host.numpy(), path, manifest, expected)
    except BaseException:
        if region is not None:
            staging.release(region)
        raise
    slab = kv_file.slab(dev_buf if dev_buf is not None else host)  # [T, 2, L, H, D]
    return Resident(manifest.user, manifest.version, manifest.model_fingerprint, slab,
                    kv_file.index, kv_file.token_ids, tier, manifest, kv_file.content_keys,
                    region=region, scales=kv_file.scales)


def _read(loc: Location, path: str, size: int, tier: str, dev: torch.device, use_mmap: bool,
          part_bytes: int, workers: int, region: Region | None = None,
          read_part: Callable[[int], None] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """The file's bytes in host memory (``region``'s, else a new buffer; and on the device
    for the CUDA gpu tier), hashed."""
    READS["kv_files"] += 1
    READS["kv_bytes"] += size
    if use_mmap:
        mapped, digest = map_and_hash(path, size, part_bytes, read_part, ahead=workers)
        return torch.from_numpy(mapped), None, digest
    cuda = dev.type == "cuda"
    host = region.data[:size] if region is not None else \
        torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    dev_buf = on_part = stream = None
    if tier == "gpu" and cuda:  # each part goes on to the device as soon as it is hashed
        dev_buf = torch.empty(size, dtype=torch.uint8, device=dev)
        stream = torch.cuda.Stream(dev)

        def copy_part(offset: int, length: int) -> None:
            with torch.cuda.stream(stream):
                dev_buf[offset:offset + length].copy_(host[offset:offset + length],
                                                      non_blocking=True)
        on_part = copy_part
    if read_part is not None:
        then = on_part
        on_part = (lambda o, n: (read_part(n), then(o, n))) if then else \
            (lambda o, n: read_part(n))
    try:
        digest = loc.blobs.read_into(path, size, host.numpy(), part_bytes=part_bytes,
                                     workers=workers, on_part=on_part)
    finally:
        if stream is not None:
            stream.synchronize()
    return host, dev_buf, digest
