"""`report.html`: one self-contained page per run, plots drawn by matplotlib and embedded as PNG.

Sections: the scorecard (table and grouped bars per suite and checkpoint), the training curves of every stage
(loss; GRPO mean reward per reward function; DPO chosen / rejected log-probabilities), quantization (error of each
format as a fraction of the weights' spread, size per checkpoint) and latency through the server per checkpoint.
Everything comes from the run's manifests and `scorecard.json`, so a report can be redrawn without a model.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from posttrain.artifacts import read_manifest
from posttrain.evaluation.scorecard import HEADERS, render_markdown

STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:1em}pre{background:#f7f7f7;padding:1em;white-space:pre-wrap}"""


def png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(h["step"], h[key]) for h in history if key in h and h[key] is not None and "step" in h]
    return [p[0] for p in points], [p[1] for p in points]


def training_curves(stage_dirs: list[Path]) -> list[tuple[str, str]]:
    """(title, <img>) per plot: each stage's loss, GRPO rewards per function, DPO chosen/rejected log-probs."""
    import matplotlib.pyplot as plt

    plots = []
    for stage_dir in stage_dirs:
        manifest = read_manifest(stage_dir) or {}
        history = (manifest.get("metrics") or {}).get("log_history") or []
        if not history:
            continue
        stage = manifest.get("stage", stage_dir.name)
        steps, loss = series(history, "loss")
        if steps:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot(steps, loss, marker=".")
            ax.set(title=f"{stage}: training loss", xlabel="step", ylabel="loss")
            ax.grid(alpha=0.3)
            plots.append((f"{stage} loss", png(fig)))
        reward_keys = sorted({k for h in history for k in h if k.startswith("rewards/") and k.endswith("/mean")})
        if stage == "grpo" and reward_keys:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            for key in reward_keys:
                ax.plot(*series(history, key), marker=".", label=key.split("/")[1])
            ax.plot(*series(history, "reward"), color="black", linestyle="--", label="weighted total")
            ax.set(title="grpo: mean reward per reward function", xlabel="step", ylabel="reward")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            plots.append(("grpo rewards", png(fig)))
        if stage == "grpo" and any("equal_reward_groups" in h for h in history):
            plots.append(("grpo sampling", sampling_plot(history)))
        if stage == "dpo" and any("logps/chosen" in h for h in history):
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot(*series(history, "logps/chosen"), marker=".", label="chosen")
            ax.plot(*series(history, "logps/rejected"), marker=".", label="rejected")
            ax.set(title="dpo: log-probability of the replies", xlabel="step", ylabel="sum log p")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            plots.append(("dpo log-probabilities", png(fig)))
    return plots


def sampling_plot(history: list[dict]) -> str:
    """Per logging step: completions generated and trained on (dynamic sampling, grpo.sampling) and the share of
    generated groups whose rewards were all equal (zero advantage: filtered out, or trained on for nothing)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(*series(history, "equal_reward_groups"), marker=".", color="tab:red", label="groups all equal (share)")
    ax.set(title="grpo: groups that carried no signal", xlabel="step", ylabel="share of generated groups", ylim=(0, 1))
    if any("sampling/generated" in h for h in history):
        counts = ax.twinx()
        counts.plot(*series(history, "sampling/generated"), marker=".", label="completions generated")
        counts.plot(*series(history, "sampling/trained"), marker=".", linestyle="--", label="completions trained on")
        counts.set_ylabel("completions per step")
        counts.legend(fontsize=8, loc="upper right")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return png(fig)


def scorecard_bars(card: dict) -> str | None:
    import matplotlib.pyplot as plt
    import numpy as np

    rows, suites = card["rows"], card["suites"]
    if not rows or not suites:
        return None
    columns = []
    for s in suites:
        columns.append((HEADERS.get(s, s), s))
        if f"{s}_pass@1" in rows[0]:
            columns.append((f"{s} pass@1", f"{s}_pass@1"))
    x = np.arange(len(columns))
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(columns)), 3.8))
    for i, row in enumerate(rows):
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, [row.get(k, 0) for _, k in columns], width,
               label=row["checkpoint"])
    ax.set_xticks(x, [h for h, _ in columns], fontsize=8)
    ax.set(ylim=(0, 1.05), ylabel="score", title="scorecard: every suite, every checkpoint (through the server)")
    ax.legend(fontsize=8, ncol=min(len(rows), 6), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def quantization_plot(card: dict) -> str | None:
    import matplotlib.pyplot as plt

    quant = card.get("quantization") or {}
    if not quant:
        return None
    first = next(iter(quant.values()))
    errors = first["format_errors"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.bar(list(errors), [v["of_spread"] for v in errors.values()], color="tab:orange")
    a.set(title=f"round-to-nearest error on {first['parent']}'s weights", ylabel="rms error / weight std")
    a.tick_params(axis="x", labelsize=8, rotation=30)
    labels = [first["parent"]] + list(quant)
    sizes = [first["parent_size_mb"]] + [q["size_mb"] for q in quant.values()]
    b.bar(labels, sizes, color="tab:blue")
    b.set(title="size on disk", ylabel="MB")
    for ax in (a, b):
        ax.grid(axis="y", alpha=0.3)
    return png(fig)


def latency_plot(card: dict) -> str | None:
    import matplotlib.pyplot as plt

    rows = [r for r in card["rows"] if r.get("latency")]
    if not rows:
        return None
    labels = [r["checkpoint"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.bar(labels, [r["latency"]["ttft_ms"] for r in rows], color="tab:green")
    a.set(title="time to first token (median, client side)", ylabel="ms")
    b.bar(labels, [r["latency"]["decode_tok_s"] or 0 for r in rows], color="tab:purple")
    b.set(title="decode speed (median, one stream)", ylabel="tokens / s")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, rotation=30)
        ax.grid(axis="y", alpha=0.3)
    return png(fig)


def markdown_tables_to_html(markdown: str) -> str:
    """The scorecard's Markdown (pipe tables and paragraphs) as HTML, escaped."""
    out, table = [], []

    def flush():
        if table:
            head, *body = [[html.escape(c.strip()) for c in line.strip("|").split("|")] for line in table]
            out.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in body) + "</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                table.append(line)
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level + 1}>{html.escape(line.lstrip('# '))}</h{level + 1}>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


def write_report(run_dir: Path, card: dict, stage_dirs: list[Path]) -> Path:
    """Draw every plot and write `report.html` (atomically: a half-written report never looks finished)."""
    import matplotlib

    matplotlib.use("Agg")
    sections = [f"<h1>posttrain run {html.escape(card['run'])}</h1>",
                markdown_tables_to_html(render_markdown(card).split("\n", 1)[1])]
    for title, image in (("Scorecard", scorecard_bars(card)), ("Quantization", quantization_plot(card)),
                         ("Latency through the server", latency_plot(card))):
        if image:
            sections.append(f"<h2>{title}</h2>{image}")
    curves = training_curves(stage_dirs)
    if curves:
        sections.append("<h2>Training curves</h2><div class='grid'>"
                        + "".join(f"<div>{image}</div>" for _, image in curves) + "</div>")
    examples = [(r["checkpoint"], s, e) for r in card["rows"] for s in card["suites"]
                for e in r.get(f"{s}_examples", [])[:1]]
    if examples:
        sections.append("<h2>Example replies</h2>" + "".join(
            f"<p><b>{html.escape(c)} / {html.escape(s)}</b> (score {e['score']})</p>"
            f"<pre>{html.escape(str(e['prompt']))}\n\n→ {html.escape(str(e['completion']))}</pre>"
            for c, s, e in examples))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>posttrain {html.escape(card['run'])}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>")
    path = Path(run_dir) / "report.html"
    tmp = path.with_name(".report.html.tmp")
    tmp.write_text(page)
    tmp.replace(path)
    return path
