"""Where a run's base model came from, for the scorecard's header.

The first manifest of the chain (followed from an evaluated checkpoint through each manifest's parent) is the
stage that loaded the base model. Its config names the model (source, hub id or path, revision) and its
`base_model` field the directory it read. The weights are identified by what can be checked:
- the tiny world's root builds the model itself, so its own manifest's sha256 of each weight file;
- a GGUF model's cached copy carries the source file's sha256 (`gguf_source.json`);
- any other local directory is hashed here, which reads its weights once per eval.
A hub id that is not on this disk has only its id and revision. A name that claims refusals were removed
(`posttrain.models.loading.REFUSALS_REMOVED`) is listed, so the header can point at the safety suites.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.artifacts import read_manifest, sha256_file, weight_files
from posttrain.models.loading import GGUF_SOURCE, REFUSALS_REMOVED


def chain_root(stage_dir: Path) -> tuple[Path, dict] | None:
    """(directory, manifest) of the first stage in the chain that ends at `stage_dir`; None without a manifest."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        return None
    seen = {str(Path(stage_dir).resolve())}
    while (manifest.get("parent") or {}).get("path") and manifest["parent"]["path"] not in seen:
        parent = Path(manifest["parent"]["path"])
        seen.add(str(parent))
        up = read_manifest(parent)
        if up is None:
            break
        stage_dir, manifest = parent, up
    return Path(stage_dir), manifest


def base_model(stage_dirs: list[Path]) -> dict | None:
    """The base model of the first checkpoint with a manifest: its name, revision, location and file hashes."""
    root = next((r for r in (chain_root(d) for d in stage_dirs) if r is not None), None)
    if root is None:
        return None
    root_dir, manifest = root
    model = (manifest.get("config") or {}).get("model") or {}
    name = str(model.get("name_or_path") or "")
    location = manifest.get("base_model")
    info = {"root_stage": manifest.get("stage"), "root": str(root_dir), "source": model.get("source"),
            "name_or_path": name or None, "revision": model.get("revision"), "location": location,
            "refusals_removed": [w for w in REFUSALS_REMOVED if w in f"{name} {location or ''}".lower()]}
    if model.get("source") == "tiny" or location is None:
        info["files"] = {k: v for k, v in (manifest.get("weights") or {}).items()}
        info["files_from"] = f"the {manifest.get('stage')} stage's manifest (the model was built there)"
    elif (Path(location) / GGUF_SOURCE).is_file():
        source = json.loads((Path(location) / GGUF_SOURCE).read_text())
        info["files"] = {Path(source["gguf"]).name: source["sha256"]}
        info["files_from"] = f"{GGUF_SOURCE} (the GGUF file the cached copy was made from)"
    elif Path(location).is_dir():
        info["files"] = {str(p.relative_to(location)): sha256_file(p) for p in weight_files(Path(location))}
        info["files_from"] = "hashed at eval time"
    else:
        info["files"], info["files_from"] = {}, "a hub id not on this disk: its id and revision only"
    return info


def render_base_model(info: dict | None) -> list[str]:
    if not info:
        return []
    name = info["name_or_path"] or f"built by the {info['root_stage']} stage"
    revision = f" at revision {info['revision']}" if info.get("revision") else ""
    lines = [f"Base model: {name}{revision} (source {info['source']}, read from {info['location'] or info['root']});"
             f" weights from {info['files_from']}:"]
    lines += [f"- `{file}` sha256 {digest}" for file, digest in sorted(info["files"].items())]
    for word in info["refusals_removed"]:
        lines.append(f"- Its name says '{word}': {REFUSALS_REMOVED[word]}. The safety suites in the table below "
                     "measure that claim.")
    return ["", *lines]
