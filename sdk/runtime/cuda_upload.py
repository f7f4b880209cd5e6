"""The weights' one upload to the device, from the mmap'ed .colibri file in UPLOAD_CHUNK pieces: through two pinned
staging buffers on a discrete GPU, straight from the mapping on an integrated one (e.g. Jetson Orin), dropping each
chunk's pages afterwards so the weights are not resident twice (docs/runtime-cuda.md, "Load").
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from .. import catalog
from ..format.constants import HEADER_SIZE
from .driver import check

UPLOAD_CHUNK = 64 << 20  # bytes per weight upload step


class WeightUpload:
    """The upload steps of `CudaBackend` (it supplies `_cu`, `_res`, `header`, `integrated`, `_alloc`, `_pinned`)."""

    def _upload_weights(self, path) -> int:
        """Copy the .colibri data after the header into one device buffer; returns its device pointer."""
        cu, stream = self._cu, self._res.stream
        size = self.header.data_size
        dst = self._alloc(size + catalog.WEIGHTS_TAIL_BYTES)  # the GEMV's aligned windows may read past the data
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # the path was checked by Bundle (no links)
        try:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            try:
                if self.integrated:
                    self._upload_integrated(fd, mapping, dst, size)
                else:
                    self._upload_staged(mapping, dst, size)
            finally:
                mapping.close()
        finally:
            os.close(fd)
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return dst

    def _upload_integrated(self, fd: int, mapping: mmap.mmap, dst: int, size: int) -> None:
        """Copy straight from the mapping, then drop the copied pages: GPU and CPU share the DRAM, so keeping the
        file's pages resident would hold the weights twice."""
        cu = self._cu
        page = mmap.PAGESIZE
        dropped = 0  # file offset up to which pages were dropped (page-aligned)
        for offset in range(0, size, UPLOAD_CHUNK):
            n = min(UPLOAD_CHUNK, size - offset)
            start = HEADER_SIZE + offset
            chunk = np.frombuffer(mapping, dtype=np.uint8, count=n, offset=start)
            try:
                check(cu.cuMemcpyHtoD(cu.CUdeviceptr(dst + offset), chunk.ctypes.data, n), "cuMemcpyHtoD")
            finally:
                # Release the view even when the copy fails: an exported buffer would make mapping.close() raise
                # BufferError and hide the CudaError.
                del chunk
            end = (start + n) // page * page if offset + n < size else len(mapping)
            if end > dropped:
                mapping.madvise(mmap.MADV_DONTNEED, dropped, end - dropped)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, dropped, end - dropped, os.POSIX_FADV_DONTNEED)
                dropped = end

    def _upload_staged(self, mapping: mmap.mmap, dst: int, size: int) -> None:
        """Two pinned staging buffers: fill one while the other's copy runs."""
        cu, res = self._cu, self._res
        chunk_size = min(UPLOAD_CHUNK, max(size, 1))
        stages = [self._pinned(chunk_size) for _ in range(2)]
        events = []
        for _ in range(2):  # recorded one by one: if the second fails, close() still destroys the first
            events.append(check(cu.cuEventCreate(0), "cuEventCreate"))
            res.events.append(events[-1])
        source = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=HEADER_SIZE)
        try:
            for i, offset in enumerate(range(0, size, chunk_size)):
                n = min(chunk_size, size - offset)
                ptr, view = stages[i % 2]
                if i >= 2:
                    check(cu.cuEventSynchronize(events[i % 2]), "cuEventSynchronize")
                view[:n] = source[offset : offset + n]
                check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dst + offset), ptr, n, res.stream), "cuMemcpyHtoDAsync")
                check(cu.cuEventRecord(events[i % 2], res.stream), "cuEventRecord")
        finally:
            del source
        # The staging buffers (up to 2 x 64 MiB page-locked) and their events are not kept for the backend's life.
        check(cu.cuStreamSynchronize(res.stream), "cuStreamSynchronize")
        staged = [ptr for ptr, _ in stages]
        stages = view = None  # no NumPy view of the freed memory stays reachable
        res.host_ptrs = [p for p in res.host_ptrs if int(p) not in staged]
        res.events = [e for e in res.events if all(e is not x for x in events)]
        for ptr in staged:
            check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")
        for event in events:
            check(cu.cuEventDestroy(event), "cuEventDestroy")
