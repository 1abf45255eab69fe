"""Device memory telemetry for live engines: NVML on a GPU, process memory without one.

On a GPU host :class:`MemoryTelemetry` reads every device's used/total memory through
nvidia-ml-py (``import pynvml``) at each control tick. vLLM pre-allocates its KV pool, so
NVML's "used" sits near ``gpu_memory_utilization`` whatever the load (DESIGN.md, Guard):
it serves the memory breakdown and spotting other processes on the GPU, while load decisions
read the engine's KV cache usage.

Without a GPU (no driver, no device, or nvidia-ml-py missing) the first read catches the
failure ONCE, logs it once, and from then on every reading falls back to this process's
resident memory and the host's total memory, with ``source="process"`` and a ``note`` that
says so; the engine's KV cache usage is passed through so the reading still tells how full
the KV pool is.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["DeviceMemory", "MemoryReading", "MemoryTelemetry", "host_memory_total_bytes",
           "process_rss_bytes"]

_LOG = logging.getLogger(__name__)

Source = Literal["nvml", "process"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Memory of one GPU as NVML reports it.

    :param index: NVML device index.
    :param name: device name.
    :param used_bytes: memory in use (all processes).
    :param total_bytes: device memory.
    """

    index: int
    name: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One memory reading for one engine.

    :param source: ``"nvml"`` (GPU memory) or ``"process"`` (no GPU: this process's resident
        memory over the host's total memory).
    :param used_bytes: memory in use on the engine's device (or by this process).
    :param total_bytes: memory of the engine's device (or of the host).
    :param devices: every GPU NVML sees (empty without NVML).
    :param kv_cache_usage: the engine's KV cache usage passed in by the caller (fraction), or
        ``None``.
    :param note: why the fallback is in use (empty for NVML readings).
    """

    source: Source
    used_bytes: int
    total_bytes: int
    devices: tuple[DeviceMemory, ...]
    kv_cache_usage: float | None
    note: str = ""


def process_rss_bytes() -> int:
    """Resident memory of this process (psutil, else ``/proc/self/statm``; 0 if neither)."""
    try:
        psutil: Any = importlib.import_module("psutil")
        return int(psutil.Process().memory_info().rss)
    except (ImportError, OSError):
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text(encoding="ascii").split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_memory_total_bytes() -> int:
    """Total host memory (psutil, else ``/proc/meminfo``; 0 if neither)."""
    try:
        psutil: Any = importlib.import_module("psutil")
        return int(psutil.virtual_memory().total)
    except (ImportError, OSError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemoryTelemetry:
    """Reads device memory each tick; NVML is initialised on the first read (no I/O here).

    :param device_index: the NVML index of the engine's GPU (default 0, or the first entry of
        ``CUDA_VISIBLE_DEVICES`` when it is a plain index list; a bad index falls back to 0).
    :param logger: where the one-time fallback message goes.
    """

    def __init__(self, device_index: int | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.device_index = device_index
        self._logger = logger or _LOG
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._failure: str | None = None
        self._initialised = False

    @property
    def failure(self) -> str | None:
        """Why NVML is not used (``None`` while it works or before the first read)."""
        return self._failure

    @property
    def source(self) -> Source:
        """Where readings come from (``"nvml"`` until a failure is seen)."""
        return "process" if self._failure is not None else "nvml"

    def read(self, kv_cache_usage: float | None = None) -> MemoryReading:
        """Memory now: NVML's per-device used/total, or the process/host fallback.

        :param kv_cache_usage: the engine's KV cache usage, carried in the reading.
        """
        if not self._initialised:
            self._init()
        if self._failure is None:
            try:
                devices = tuple(self._device(i, h) for i, h in enumerate(self._handles))
            except Exception as exc:  # pynvml.NVMLError (a driver can go away mid-run)
                if not self._is_nvml_error(exc):
                    raise
                self._fail(f"NVML read failed: {exc}")
            else:
                mine = self._mine(devices)
                return MemoryReading("nvml", mine.used_bytes, mine.total_bytes, devices,
                                     kv_cache_usage)
        return MemoryReading("process", process_rss_bytes(), host_memory_total_bytes(), (),
                             kv_cache_usage,
                             note=f"no GPU memory reading ({self._failure}); process RSS / "
                                  f"host memory shown, KV usage from the engine")

    def close(self) -> None:
        """Shut NVML down (safe to call twice)."""
        if self._nvml is not None and self._failure is None and self._initialised:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                if not self._is_nvml_error(exc):
                    raise
        self._initialised = False
        self._handles = []

    # ------------------------------------------------------------------ internals
    def _init(self) -> None:
        self._initialised = True
        try:
            self._nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            self._fail(f"nvidia-ml-py is not installed ({exc})")
            return
        try:
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            self._fail(f"NVML unavailable: {exc}")
            return
        if not self._handles:
            self._fail("NVML sees no GPU")

    def _is_nvml_error(self, exc: BaseException) -> bool:
        error_type = getattr(self._nvml, "NVMLError", None)
        return isinstance(error_type, type) and isinstance(exc, error_type)

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._logger.warning("GPU memory telemetry off: %s; reporting process memory and "
                                 "the engine's KV cache usage instead", reason)
        self._failure = reason

    def _device(self, index: int, handle: Any) -> DeviceMemory:
        info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        name = self._nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return DeviceMemory(index, str(name), int(info.used), int(info.total))

    def _mine(self, devices: tuple[DeviceMemory, ...]) -> DeviceMemory:
        index = self.device_index
        if index is None:
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(first) if first.isdigit() else 0
        return devices[index] if 0 <= index < len(devices) else devices[0]
