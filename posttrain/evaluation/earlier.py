"""The rows an eval keeps from the run's last scorecard: `posttrain eval 'eval.checkpoints=[dpo-int4-gptq]'` scores
one checkpoint and the scorecard still holds the others, so the claims and the paired changes read one scorecard.

A row is kept only when it is comparable with the rows scored now: the last scorecard used the same eval config
(every key but `checkpoints` and `base`, which pick rows rather than change scores) and seed, the checkpoint is not
scored again, and its artifact is unchanged (the manifest's hash is the one the row was scored from). Anything else
is dropped, and the log says which rows and why.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from posttrain.artifacts import manifest_sha256

log = logging.getLogger("posttrain")
ROW_PICKERS = ("checkpoints", "base")  # eval keys that choose which rows are scored, not how


def _comparable(config: dict | None) -> dict | None:
    if config is None:
        return None
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in ROW_PICKERS}))


def row_stage_dir(run_dir: Path, row: dict) -> Path:
    """The stage directory in `run_dir` that a scorecard row's checkpoint came from (rows name their artifact's
    path as scored; the run directory may have moved since)."""
    return run_dir / Path(str(row.get("artifact", ""))).name


def _unchanged(run_dir: Path, row: dict) -> bool:
    if row.get("checkpoint") == "base":
        return True
    stage_dir = row_stage_dir(run_dir, row)
    return (stage_dir / "manifest.json").is_file() and manifest_sha256(stage_dir) == row.get("manifest_sha256")


def earlier_rows(run_dir: Path, eval_config: dict | None, seed: int) -> list[dict]:
    """The last scorecard's rows, when it was scored with this eval config and seed and each row's artifact is
    unchanged; [] when there is no scorecard or it is not comparable (logged)."""
    path = run_dir / "scorecard.json"
    if not path.is_file():
        return []
    try:
        card = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        log.warning("eval: %s is not valid JSON (%s); its rows are not kept", path, err)
        return []
    rows = card.get("rows") or []
    if not rows:
        return []
    labels = ", ".join(r.get("checkpoint", "?") for r in rows)
    if card.get("seed") != seed or _comparable(card.get("eval_config")) != _comparable(eval_config):
        log.info("eval: %s was scored with another eval config or seed; its rows (%s) are replaced", path, labels)
        return []
    kept = [r for r in rows if _unchanged(run_dir, r)]
    changed = [r.get("checkpoint", "?") for r in rows if r not in kept]
    if changed:
        log.info("eval: rows of %s whose artifact changed since they were scored are dropped: %s", path,
                 ", ".join(changed))
    return kept


def with_earlier_rows(scored: list[dict], earlier: list[dict]) -> list[dict]:
    """The rows scored now, plus the earlier rows of checkpoints not scored now, base first, then in stage order
    (the artifacts' NN- directory names)."""
    labels = {r["checkpoint"] for r in scored}
    kept = [r for r in earlier if r["checkpoint"] not in labels]
    if kept:
        log.info("eval: keeping the last scorecard's rows of %s (same eval config, seed and artifacts)",
                 ", ".join(r["checkpoint"] for r in kept))
    return sorted(scored + kept, key=lambda r: (r["checkpoint"] != "base", Path(str(r.get("artifact", ""))).name))
