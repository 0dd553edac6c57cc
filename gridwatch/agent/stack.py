"""The software stack fingerprint a node reports in its hello: versions and their hash."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import sys

import msgspec
from loguru import logger

from gridwatch.wire.protocol import StackFingerprint, Text

# Packages whose version decides whether ranks of one job agree on numerics
# and collectives; a node that differs here is the first suspect.
PACKAGES = (
    "torch",
    "numpy",
    "triton",
    "nvidia-nccl-cu12",
    "nvidia-cudnn-cu12",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cublas-cu12",
    "nvidia-ml-py",
    "gridwatch",
)
OVERRIDE_ENV = "GRIDWATCH_STACK_OVERRIDE"
_FIELDS = ("driver", "cuda", "nccl", "kernel", "python")


def _package_versions(names: list[str]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _nvml_versions() -> tuple[str | None, str | None]:
    """Driver and its CUDA version (``nvidia-smi`` header), or ``None`` without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no library, no driver: all mean "no GPU stack here"
        return None, None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        return driver, f"{cuda // 1000}.{cuda % 1000 // 10}"
    except pynvml.NVMLError as exc:
        logger.debug("NVML versions unavailable: {}", exc)
        return None, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _torch_versions() -> tuple[str | None, str | None]:
    """CUDA and NCCL as torch was built with them, only if torch is already imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    nccl = None
    try:
        raw = torch.cuda.nccl.version()
        nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    except Exception:  # CPU builds have no NCCL; that is an answer, not an error
        nccl = None
    return cuda, nccl


def parse_override(text: str) -> dict[str, str]:
    """``"torch=2.12.0,driver=550.1"`` as a mapping; malformed entries are skipped with a warning."""
    out = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, version = item.partition("=")
        if not sep or not name.strip() or not version.strip():
            logger.warning("{}: ignoring {!r}, expected name=version", OVERRIDE_ENV, item)
            continue
        out[name.strip()] = version.strip()
    return out


def _plain(value: str | None) -> str | None:
    return None if value is None else str(value)


def stack_hash(fp: StackFingerprint) -> str:
    """sha256 over every field but the hash, in a canonical order: equal stacks, equal hashes."""
    data: dict[str, object] = {name: _plain(getattr(fp, name)) for name in _FIELDS}
    data["packages"] = {str(k): str(v) for k, v in sorted(fp.packages.items())}
    return hashlib.sha256(msgspec.json.encode(data, order="sorted")).hexdigest()


def fingerprint(extra_packages: list[str] | None = None, *, nvml: bool = True) -> StackFingerprint:
    """What this node runs: driver, CUDA, NCCL, kernel, Python, package versions, and a hash.

    Package versions come from installed metadata (torch is never imported for
    this). ``GRIDWATCH_STACK_OVERRIDE="pkg=ver,..."`` replaces versions; the
    names ``driver``, ``cuda``, ``nccl``, ``kernel`` and ``python`` replace
    those fields, so a demo can make one node deliberately different.
    """
    names = list(dict.fromkeys([*PACKAGES, *(extra_packages or [])]))
    packages = _package_versions(names)
    driver, cuda = _nvml_versions() if nvml else (None, None)
    torch_cuda, torch_nccl = _torch_versions()
    fields: dict[str, str | None] = {
        "driver": driver,
        "cuda": cuda or torch_cuda,
        "nccl": packages.get("nvidia-nccl-cu12") or torch_nccl,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for name, version in parse_override(os.environ.get(OVERRIDE_ENV, "")).items():
        if name in fields:
            fields[name] = version
        else:
            packages[name] = version
    fp = msgspec.structs.replace(
        StackFingerprint(packages={k: Text(v) for k, v in sorted(packages.items())}),
        **{k: Text(v) if v is not None else None for k, v in fields.items()},
    )
    fp.hash = Text(stack_hash(fp))
    return fp
