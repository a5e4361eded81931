"""The byte layout of one weight slot, its sequence lock, and the reader that never returns a torn version.

A slot is one flat buffer (a POSIX shm file for the shm transport, process memory on the learner and a staging
shm file on the sampler for tcp):

    [0, 4096)          header: magic, seq, version, manifest offset/length/checksum, end of data
    [4096, data_end)   tensors, each 64-byte aligned, in the dtype the sampler loads
    [manifest_off, +)  manifest: a serialized WeightManifest (proto/dgrpo/v1/weights.proto): run id, version, and
                       per tensor name/dtype/shape/offset/nbytes/xxh3-64

Sequence lock (Linux kernel seqlock, single writer): the writer makes `seq` odd, writes data, manifest and header
fields, then makes `seq` even. A reader (`SlotReader`) checks `seq` is even and equal to the announced one,
verifies the checksums and loads the tensors in place, then reads `seq` again: unchanged means no write overlapped
anything it verified or loaded, so what was verified is exactly what was loaded. Stores through mmap are not
reordered on x86-64 (TSO); on weakly ordered CPUs (ARM) a fence would be needed between the steps.
"""

from __future__ import annotations

import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from dgrpo.weights.protocol import Manifest

MAGIC = b"DGRPOW03"  # 03: streamed writes (progress + checksum table); 02: protobuf manifest; 01: JSON
# magic, seq, version, manifest_off, manifest_len, manifest_xxh, data_end, progress, table_off
HEADER = struct.Struct("<8sQQQQQQQQ")
HEADER_BYTES = 4096
ALIGN = 64
SEQ_OFFSET = 8  # byte offset of `seq` inside the header
MANIFEST_XXH_OFFSET = 40
PROGRESS_OFFSET = 56  # byte offset of `progress` (tensors complete so far) inside the header
COMPLETION_WINDOW_S = 1.0  # how long a reader waits out a streamed write's last step (see SlotReader._open)
ABORTED = (1 << 64) - 1  # `progress` of a streamed write that failed half-way (the slot holds no version)
UNKNOWN_XXH3 = (1 << 64) - 1  # a streamed manifest's checksum until its tensor is written (same encoded length)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class WeightIntegrityError(RuntimeError):
    """A slot cannot be loaded: torn read, overwritten slot, or checksum mismatch. The old weights stay."""


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        return dtype
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPES)}")


def checksum(buf) -> int:
    """xxh3-64 of a buffer (~15 GB/s on one core here; crc32 runs at ~1.6 GB/s)."""
    return xxhash.xxh3_64_intdigest(buf)


@contextmanager
def one_thread():
    """Run torch copies on one thread: a memory-bound copy gains little from more, and on busy cores OpenMP's
    spin-waiting made a 2 MB copy 16x slower (7 ms vs 0.4 ms measured here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Header:
    seq: int
    version: int
    manifest_off: int
    manifest_len: int
    manifest_xxh: int
    data_end: int
    progress: int
    table_off: int

    @property
    def used_bytes(self) -> int:
        return self.manifest_off + self.manifest_len


def read_header(buf) -> Header:
    magic, *fields = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WeightIntegrityError(f"not a dgrpo weight slot (magic {magic!r})")
    return Header(*fields)


def read_seq(buf) -> int:
    return struct.unpack_from("<Q", buf, SEQ_OFFSET)[0]


def read_progress(buf) -> int:
    return struct.unpack_from("<Q", buf, PROGRESS_OFFSET)[0]


@dataclass
class WrittenSlot:
    """What a write produced: the announcement's slot fields."""

    seq: int
    nbytes: int
    manifest_xxh3: int
    manifest: Manifest


class SlotWriter:
    """Writes versions into one growable buffer; `ensure(nbytes)` must return a writable buffer of >= nbytes."""

    def __init__(self, ensure):
        self._ensure = ensure
        self.seq = 0

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, dtype: str,
              run_id: str, adapter_config: str = "") -> WrittenSlot:
        """Cast + copy every tensor into the slot, seqlock-protected; return the manifest. `adapter_config`: PEFT's
        adapter_config.json when the tensors are a LoRA adapter (dgrpo.weights.lora)."""
        target = DTYPES[dtype]
        buf = self._ensure(HEADER_BYTES)
        self.seq += 1  # odd: a write is in progress, readers reject the slot
        struct.pack_into("<Q", buf, SEQ_OFFSET, self.seq)
        struct.pack_into("<8s", buf, 0, MAGIC)
        manifest = Manifest(run_id=run_id, version=version, dtype=dtype, adapter_config=adapter_config)
        offset = HEADER_BYTES
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * target.itemsize
            xxh = self._copy(tensor, target, offset, nbytes)
            manifest.tensors.add(name=name, dtype=dtype, shape=list(tensor.shape), offset=offset, nbytes=nbytes,
                                 xxh3=xxh)
            offset = _align(offset + nbytes)
        if not manifest.tensors:
            raise ValueError(f"publish(version={version}): no tensors given")
        raw = manifest.SerializeToString()
        buf = self._ensure(offset + len(raw))
        buf[offset:offset + len(raw)] = raw
        HEADER.pack_into(buf, 0, MAGIC, self.seq, version, offset, len(raw), checksum(raw), offset, 0, 0)
        self.seq += 1  # even: complete
        struct.pack_into("<Q", buf, SEQ_OFFSET, self.seq)
        return WrittenSlot(self.seq, offset + len(raw), checksum(raw), manifest)

    def write_streamed(self, layout: list[tuple[str, list[int]]], named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int, dtype: str, run_id: str, on_started: Callable[[WrittenSlot], None]) -> WrittenSlot:
        """Like `write`, but the layout is fixed first and `on_started` is called before any tensor is written, so
        readers can load each tensor as soon as it is complete (`SlotReader(streamed=True)`): the slot holds the
        manifest (checksums UNKNOWN_XXH3) from the start, a table of per-tensor checksums, and `progress`, the count of
        tensors complete. `seq` stays odd until the last tensor is in. A write that fails half-way marks the slot
        ABORTED (version 0), so waiting readers give up at once."""
        target = DTYPES[dtype]
        manifest = Manifest(run_id=run_id, version=version, dtype=dtype)
        table_off = HEADER_BYTES
        offset = _align(table_off + 8 * len(layout))
        for name, shape in layout:
            nbytes = int(np.prod(shape)) * target.itemsize if len(shape) else target.itemsize
            manifest.tensors.add(name=name, dtype=dtype, shape=list(shape), offset=offset, nbytes=nbytes,
                                 xxh3=UNKNOWN_XXH3)
            offset = _align(offset + nbytes)
        if not manifest.tensors:
            raise ValueError(f"publish(version={version}): no tensors given")
        raw = manifest.SerializeToString()  # fixed64 placeholders: filling the checksums in keeps the length
        buf = self._ensure(offset + len(raw))
        self.seq += 1
        struct.pack_into("<Q", buf, SEQ_OFFSET, self.seq)
        buf[offset:offset + len(raw)] = raw
        HEADER.pack_into(buf, 0, MAGIC, self.seq, version, offset, len(raw), checksum(raw), offset, 0, table_off)
        on_started(WrittenSlot(self.seq, offset + len(raw), checksum(raw), Manifest.FromString(raw)))
        try:
            for i, (entry, (name, tensor)) in enumerate(zip(manifest.tensors, named_tensors, strict=True)):
                if name != entry.name or list(tensor.shape) != list(entry.shape):
                    raise ValueError(f"publish(version={version}): tensor {i} is {name} {list(tensor.shape)}, "
                                     f"the layout said {entry.name} {list(entry.shape)}")
                entry.xxh3 = self._copy(tensor, target, entry.offset, entry.nbytes)
                struct.pack_into("<Q", buf, table_off + 8 * i, entry.xxh3)
                struct.pack_into("<Q", buf, PROGRESS_OFFSET, i + 1)  # after the data and its checksum (x86 TSO)
        except BaseException:
            struct.pack_into("<QQ", buf, SEQ_OFFSET, self.seq, 0)  # version 0: the slot holds nothing
            struct.pack_into("<Q", buf, PROGRESS_OFFSET, ABORTED)
            self.seq += 1
            struct.pack_into("<Q", buf, SEQ_OFFSET, self.seq)
            raise
        final = manifest.SerializeToString()
        assert len(final) == len(raw), "fixed64 checksums keep the manifest's length"
        buf[offset:offset + len(final)] = final
        struct.pack_into("<Q", buf, MANIFEST_XXH_OFFSET, checksum(final))
        self.seq += 1  # even: complete
        struct.pack_into("<Q", buf, SEQ_OFFSET, self.seq)
        return WrittenSlot(self.seq, offset + len(final), checksum(final), manifest)

    def _copy(self, tensor: torch.Tensor, target: torch.dtype, offset: int, nbytes: int) -> int:
        """Copy one tensor into the slot at `offset`; its xxh3 as stored."""
        buf = self._ensure(offset + nbytes)
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        with one_thread():  # one pass: device->host, cast to the sampler's dtype, copy into the slot
            dst.view(target).view(tensor.shape).copy_(tensor.detach())
        return checksum(memoryview(buf)[offset:offset + nbytes])


class SlotReader:
    """Reads one announced version in place (no copy): opens it only if complete and untorn (or, streamed, being
    written as announced), verifies it, hands out tensor views, and tells afterwards whether a write overlapped.

    The caller keeps generation paused from the first byte loaded until `check_intact()` passed: a version whose
    slot was rewritten during the load is then never served (it loads the newest version instead). Reading in place
    costs no model-size private buffer per worker and no copy; the seqlock check moves from "before using the copy"
    to "after loading".

    Streamed (the announced `seq` is odd: the learner announced the version when its write began): `tensors()`
    waits for each tensor to be complete (bounded by `stall_timeout_s` without progress) and checks it against the
    slot's checksum table before handing it out; `check_intact()` waits for the write to finish.
    """

    def __init__(self, buf, version: int, seq: int, manifest_xxh3: int, stall_timeout_s: float = 60.0):
        self.buf, self.version, self.seq, self.stall_timeout_s = buf, version, seq, stall_timeout_s
        self.streamed = seq % 2 == 1
        self.final_seq = seq + 1 if self.streamed else seq
        header, raw = self._open(manifest_xxh3)
        self.manifest = Manifest.FromString(raw)
        _check_bounds(self.manifest, header.data_end)
        if self.streamed and header.table_off + 8 * len(self.manifest.tensors) > header.data_end:
            raise WeightIntegrityError(f"version {version}: the checksum table lies outside the slot")
        self._table_off = header.table_off
        self._data = np.frombuffer(buf, dtype=np.uint8, count=header.used_bytes)

    def _open(self, manifest_xxh3: int) -> tuple[Header, bytes]:
        """The header and manifest of this write, read consistently. A streamed write that completes rewrites its
        manifest (checksums filled in) just before `seq` turns even: a reader caught in that window sees the
        announced `seq` with the final manifest, and reads again (bounded) rather than calling it corrupt."""
        version, seq = self.version, self.seq
        deadline = time.monotonic() + COMPLETION_WINDOW_S
        while True:
            seq_now = read_seq(self.buf)
            if not self.streamed and seq_now % 2:
                raise WeightIntegrityError(f"version {version}: slot is being rewritten (seq {seq_now} odd); torn read")
            if seq_now not in (seq, self.final_seq):
                raise WeightIntegrityError(f"version {version}: slot was overwritten (seq {seq_now}, announced {seq})")
            header = read_header(self.buf)
            if header.version != version:
                raise WeightIntegrityError(f"version {version}: slot holds version {header.version}")
            if header.used_bytes > len(self.buf):
                raise WeightIntegrityError(
                    f"version {version}: slot header names {header.used_bytes} bytes, the mapping has {len(self.buf)}")
            raw = bytes(memoryview(self.buf)[header.manifest_off:header.manifest_off + header.manifest_len])
            # A streamed slot that finished meanwhile holds the final manifest (checksums filled in), not the announced.
            announced_only = seq_now == seq
            if checksum(raw) == header.manifest_xxh and (not announced_only or header.manifest_xxh == manifest_xxh3):
                break
            if not (self.streamed and announced_only) or time.monotonic() > deadline:
                raise WeightIntegrityError(f"version {version}: manifest checksum mismatch")
            time.sleep(0.001)  # the write is completing: its seq turns even within microseconds
        if read_seq(self.buf) not in (seq, self.final_seq):  # the header and manifest just read belong to this write
            raise WeightIntegrityError(f"version {version}: a write overlapped opening the slot; torn read")
        return header, raw

    def release(self) -> None:
        """Drop the reader's view of the buffer, so that the mapping can be closed."""
        self._data = None

    def check_intact(self) -> None:
        """Raise if a write started since the slot was opened (everything read since may be torn). Streamed: first
        wait for the write to finish."""
        if self.streamed:
            self._wait_written(len(self.manifest.tensors), final=True)
        seq_now = read_seq(self.buf)
        if seq_now != self.final_seq or read_header(self.buf).version != self.version:
            raise WeightIntegrityError(f"version {self.version}: a write overlapped the read "
                                       f"(seq {self.seq} -> {seq_now}); torn read rejected")

    def verify(self) -> None:
        """Recompute every tensor's checksum; raise naming the first bad tensor."""
        for t in self.manifest.tensors:
            self._verify_one(t, t.xxh3)

    def stage(self, verify: bool) -> None:
        """Staging, before generation pauses: every checksum when `verify`, then that the slot still holds what was
        verified."""
        if verify:
            self.verify()
        self.check_intact()

    def tensors(self, verify: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, read-only tensor view), in slot order. Loaders copy from them; nobody may write to them.
        `verify`: check each tensor's checksum before handing it out (what a streamed load does). Waiting for the
        writer and checksumming run one tensor ahead on a helper thread (xxhash releases the GIL), so they overlap
        the caller's load of the tensor before."""
        entries = list(self.manifest.tensors)
        if not (verify or self.streamed):
            yield from self._views(entries)
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="dgrpo-slot-check")
        # Set when this iteration ends, so a check still waiting on the writer gives up at its next poll. Only that
        # check: `check_intact`, which waits for the same write to finish afterwards, must not see it.
        given_up = threading.Event()
        try:
            pending = pool.submit(self._ready, 0, verify, given_up)
            for i, t in enumerate(entries):
                pending.result()
                if i + 1 < len(entries):
                    pending = pool.submit(self._ready, i + 1, verify, given_up)
                yield from self._views([t])
        finally:
            given_up.set()
            pool.shutdown(wait=False, cancel_futures=True)

    def _ready(self, i: int, verify: bool, given_up: threading.Event) -> None:
        t, expected = self.manifest.tensors[i], self.manifest.tensors[i].xxh3
        if self.streamed:
            self._wait_written(i, given_up=given_up)
            expected = struct.unpack_from("<Q", self.buf, self._table_off + 8 * i)[0]
        if verify:
            self._verify_one(t, expected)

    def _views(self, entries) -> Iterator[tuple[str, torch.Tensor]]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for t in entries:
                raw = torch.from_numpy(self._data[t.offset:t.offset + t.nbytes])
                yield t.name, raw.view(DTYPES[t.dtype]).view(list(t.shape))

    def _verify_one(self, t, expected: int) -> None:
        got = checksum(self._data[t.offset:t.offset + t.nbytes])
        if got != expected:
            raise WeightIntegrityError(
                f"version {self.version}: checksum mismatch in {t.name} ({got:#x} != {expected:#x})")

    def _wait_written(self, count: int, final: bool = False, given_up: threading.Event | None = None) -> None:
        """Until the streamed write has `count` tensors complete (`final`: has finished); raise if it was abandoned,
        overwritten, or made no progress for `stall_timeout_s`, or once `given_up` is set (its reader went away)."""
        last, since = -1, time.monotonic()
        while True:
            seq_now, progress = read_seq(self.buf), read_progress(self.buf)
            if progress == ABORTED:
                raise WeightIntegrityError(f"version {self.version}: the learner abandoned writing it")
            if seq_now not in (self.seq, self.final_seq):
                raise WeightIntegrityError(f"version {self.version}: slot was overwritten while streaming "
                                           f"(seq {self.seq} -> {seq_now}); torn read rejected")
            if seq_now == self.final_seq or (not final and progress > count):
                return
            if given_up is not None and given_up.is_set():
                raise WeightIntegrityError(f"version {self.version}: the read was abandoned")
            if progress != last:
                last, since = progress, time.monotonic()
            elif time.monotonic() - since > self.stall_timeout_s:
                raise WeightIntegrityError(f"version {self.version}: the write stalled at tensor {progress} of "
                                           f"{len(self.manifest.tensors)} for {self.stall_timeout_s:.0f}s")
            time.sleep(0.0002)


def open_slot(ref, mapping=None) -> tuple[SlotReader, object]:
    """(reader, mapping) of one announced version; `ref` carries path, version, seq, manifest_xxh3 and
    stall_timeout_s (a SlotRef, or the SlotUpdateInfo that carries one into vLLM's workers). A file that is gone
    raises WeightIntegrityError. `mapping(path)`: how to map the file (a cache of the caller's, kept on failure);
    by default a fresh read-only mapping, closed again when the reader refuses the slot."""
    from dgrpo.weights.shm import open_readonly

    try:
        mapped = (mapping or open_readonly)(ref.path)
    except FileNotFoundError:
        raise WeightIntegrityError(f"slot {ref.path} no longer exists (learner gone?)") from None
    try:
        return SlotReader(mapped, ref.version, ref.seq, ref.manifest_xxh3, ref.stall_timeout_s), mapped
    except BaseException:
        if mapping is None:
            try:
                mapped.close()
            except BufferError:  # a view is still alive (e.g. in a traceback); the mapping goes when it does
                pass
        raise


def completed_manifest_xxh3(ref) -> int | None:
    """The manifest id of the streamed write `ref` names (path, version, its odd announced seq) now that it is
    complete: the checksum of the manifest with every tensor's checksum filled in, the id the learner logs and
    announces once the write is done (the announcement at its start carried the id of the manifest without them).
    None when the slot holds another write by now, or is gone."""
    from dgrpo.weights.shm import open_readonly

    try:
        mapped = open_readonly(ref.path)
    except (FileNotFoundError, ValueError):  # gone, or empty
        return None
    try:
        final = ref.seq + 1
        if read_seq(mapped) != final:
            return None
        header = read_header(mapped)
        return header.manifest_xxh if header.version == ref.version and read_seq(mapped) == final else None
    except WeightIntegrityError:
        return None
    finally:
        mapped.close()


def _check_bounds(manifest: Manifest, data_end: int) -> None:
    """Every tensor lies inside the data region with the size its dtype and shape need (a manifest that passed its
    checksum was written by the learner, but a reader must not trust offsets blindly)."""
    for t in manifest.tensors:
        if t.dtype not in DTYPES:
            raise WeightIntegrityError(f"version {manifest.version}: {t.name} has dtype {t.dtype!r}")
        numel = int(np.prod(t.shape)) if len(t.shape) else 1
        if t.nbytes != numel * DTYPES[t.dtype].itemsize or t.offset < HEADER_BYTES or t.offset + t.nbytes > data_end:
            raise WeightIntegrityError(f"version {manifest.version}: {t.name} lies outside the slot's data "
                                       f"(offset {t.offset}, {t.nbytes} bytes, data ends at {data_end})")
