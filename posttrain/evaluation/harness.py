"""lm-evaluation-harness as an eval route: its tasks run against the server eval starts for each checkpoint.

lm-eval's own `local-completions` model sends the requests (prompts as the served model's token ids, `echo` and
`logprobs` for log-likelihood tasks, stop sequences for generative ones) to `/v1/completions`, exactly as it would
to vLLM, so a score here is what a user running lm-eval against `posttrain serve` gets. Tasks are lm-eval's
(`eval.lm_eval.tasks`), found in its catalogue or under `eval.lm_eval.include_path`: task YAMLs on local data
(`dataset_path: json` with `data_files`), since nothing downloads at run time. lm-eval is an optional extra
(`pip install 'posttrain[lmeval]'`); a recipe that names tasks without it fails before any server starts.
"""

from __future__ import annotations

import functools
import logging
import math

log = logging.getLogger("posttrain")
INSTALL = "pip install 'posttrain[lmeval]' (lm-eval[api]==0.4.13)"


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None, include_defaults: bool = True):
    """lm-eval's index of the tasks under include_path, and of its own catalogue with include_defaults (it reads
    every task YAML, about 15 s on 2 cores: once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def require_lm_eval(cfg) -> None:
    """Fail early, naming the fix, when tasks are asked for and lm-eval is absent or a task is unknown."""
    if not cfg.tasks:
        return
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError(f"eval.lm_eval.tasks={list(cfg.tasks)} needs lm-evaluation-harness: {INSTALL}") from None
    manager = task_manager(cfg.include_path, getattr(cfg, "include_defaults", True))
    unknown = [t for t in cfg.tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under eval.lm_eval.include_path={cfg.include_path}" if cfg.include_path else ""
        raise ValueError(f"eval.lm_eval.tasks: {unknown} are not tasks lm-eval knows{where}")


def run_tasks(base_url: str, api_key: str, model: str, tokenizer_dir: str, cfg, seed: int) -> dict:
    """Run `cfg.tasks` through the server at `base_url`; per task, lm-eval's metrics with their stderr, the
    documents scored and the task's version, as lm-eval reports them."""
    import lm_eval

    for name in ("lm-eval", "lm_eval"):  # its per-request INFO lines; warnings and errors stay
        logging.getLogger(name).setLevel(logging.WARNING)
    model_args = {"model": model, "base_url": f"{base_url}/completions", "tokenizer": tokenizer_dir,
                  "tokenizer_backend": "huggingface", "tokenized_requests": True,
                  "num_concurrent": cfg.num_concurrent, "max_retries": 1, "timeout": 600,
                  "header": {"Authorization": f"Bearer {api_key}"}}
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=list(cfg.tasks),
                                  task_manager=task_manager(cfg.include_path, getattr(cfg, "include_defaults", True)),
                                  limit=cfg.limit, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed, log_samples=False)
    results = {}
    for task, figures in out["results"].items():
        metrics, stderr = {}, {}
        for key, value in figures.items():
            if key == "alias" or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            label = name if filt in ("none", "") else f"{name} ({filt})"
            if name.endswith("_stderr"):
                stderr[label.replace("_stderr", "", 1)] = None if math.isnan(value) else float(value)
            else:
                metrics[label] = float(value)
        samples = out.get("n-samples", {}).get(task, {})
        results[task] = {"metrics": metrics, "stderr": stderr, "n": samples.get("effective"),
                         "version": out.get("versions", {}).get(task)}
    return results


def render(rows: list[dict]) -> list[str]:
    """The scorecard's lm-eval table: one line per checkpoint, task and metric, value ± lm-eval's stderr."""
    scored = [r for r in rows if r.get("lm_eval")]
    if not scored:
        return []
    lines = ["", "## lm-evaluation-harness (local-completions through the server)", "",
             "| checkpoint | task | metric | value | stderr | n |", "|---|---|---|---|---|---|"]
    for row in scored:
        for task, result in row["lm_eval"].items():
            for metric, value in result["metrics"].items():
                err = result["stderr"].get(metric)
                lines.append(f"| {row['checkpoint']} | {task} | {metric} | {value:.4f} | "
                             f"{'n/a' if err is None else f'{err:.4f}'} | {result['n']} |")
    return lines
