"""The artifact contract: `runs/<run>/<NN-stage>/` holds `model/` and a `manifest.json` written last.

A directory without a manifest is not an artifact and is never read as one. The manifest records the weight
files' sha256, so loading an artifact checks that the weights are the ones the stage wrote. While a stage runs,
its directory has one owner (`own_stage_dir`): a second run started on it stops before writing anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

MANIFEST = "manifest.json"
OWNER = "owner.lock"  # who is running the stage now: host, pid, command, start time (empty when no one is)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "hydra-core", "posttrain")


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or does not match its manifest; the message names the file."""


class StageBusyError(ArtifactError):
    """Another process is running this stage in the same directory; the message names it."""


@contextlib.contextmanager
def own_stage_dir(stage_dir: Path):
    """Hold `stage_dir` for this process while its stage runs; StageBusyError, naming the owner, if another holds it.

    The hold is an flock on `owner.lock`, which the kernel releases when its process dies, however it dies: a lock
    left by a dead process never blocks a rerun (the rerun reports whose it was and takes it over). The ranks of one
    `accelerate launch` run inside their parent's hold; under a bare torchrun, rank 0 holds it for all.
    """
    stage_dir.mkdir(parents=True, exist_ok=True)
    path = stage_dir / OWNER
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
            raise StageBusyError(f"{stage_dir} is in use by another run ({owner}); wait for it to finish or stop it, "
                                 f"or give this run another run.name") from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:
            logging.getLogger("posttrain").warning("%s: taking over from a run that ended without releasing it (%s)",
                                                   stage_dir, previous)
        me = f"host {socket.gethostname()}, pid {os.getpid()}, since {now()}: {' '.join(sys.argv)[:300]}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: the file stays (removing it would race with a run opening it)
    finally:
        os.close(fd)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def write_json_atomic(path: Path, data: dict) -> None:
    """Temp file in the same directory, fsync, rename: a reader sees the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(stage_dir: Path) -> dict | None:
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: manifest is not valid JSON ({err})") from err


def manifest_sha256(stage_dir: Path) -> str:
    return sha256_file(Path(stage_dir) / MANIFEST)


def parent_ref(parent: Path | None) -> dict | None:
    if parent is None:
        return None
    return {"path": str(Path(parent).resolve()), "manifest_sha256": manifest_sha256(parent)}


def write_manifest(
    stage_dir: Path,
    *,
    stage: str,
    parent: Path | None,
    config: dict,
    config_hash: str,
    datasets: list[dict],
    metrics: dict,
    started_at: str,
    extra: dict | None = None,
) -> dict:
    """Hash every weight file under model/ and write the manifest last, atomically."""
    stage_dir = Path(stage_dir)
    model_dir = stage_dir / "model"
    weights = {str(p.relative_to(stage_dir)): sha256_file(p) for p in weight_files(model_dir)}
    if not weights:
        raise ArtifactError(f"{model_dir}: no weight files to record; refusing to mark the stage finished")
    manifest = {
        "stage": stage,
        "parent": parent_ref(parent),
        "config": config,
        "config_hash": config_hash,
        "datasets": datasets,
        "metrics": metrics,
        "weights": weights,
        "packages": package_versions(),
        "git_revision": git_revision(),
        "started_at": started_at,
        "finished_at": now(),
        **(extra or {}),
    }
    write_json_atomic(stage_dir / MANIFEST, manifest)
    return manifest


def verify_artifact(stage_dir: Path) -> dict:
    """Check that `stage_dir` is a finished artifact whose weights match its manifest; return the manifest."""
    stage_dir = Path(stage_dir)
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise ArtifactError(f"{stage_dir}: no {MANIFEST}; this is not a finished artifact")
    for rel, expected in manifest["weights"].items():
        path = stage_dir / rel
        if not path.exists():
            raise ArtifactError(f"{path}: weight file listed in {stage_dir / MANIFEST} is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"{path}: sha256 {actual[:16]}... does not match the manifest's {expected[:16]}...; "
                "the weights were changed after the stage finished"
            )
    unlisted = [p for p in weight_files(stage_dir / "model") if str(p.relative_to(stage_dir)) not in manifest["weights"]]
    if unlisted:
        raise ArtifactError(f"{unlisted[0]}: weight file not listed in {stage_dir / MANIFEST}")
    return manifest
