"""The `posttrain` command.

    posttrain run pipeline=tiny [overrides]      run a pipeline (Hydra overrides as in any Hydra app); with
                                                 --dry-run, only check what can be checked before it starts
    posttrain stage=sft model=... data=...       run one stage
    posttrain eval [run.name=<run>] [overrides]  serve each checkpoint of a run, score it through the API, write
                                                 scorecard.md/.json and report.html (default: the latest run)
    posttrain claims [run.name=<run>]            check an evaluated run's claims, the tiny world's or (a run
                                                 scored on gsm8k) a real model's; exit 1: a claim failed, named
                                                 with what was measured and needed
    posttrain serve <artifact|dir|hub id> [port=8000 api_key=... backend=posttrain|vllm ...]
                                                 the OpenAI-compatible server (posttrain serve --help)
    posttrain template render [--template ...]   print a rendered chat, its token count and control-token ids
    posttrain template cost --config ...         tokens and KV bytes per turn, thinking dropped vs kept
    posttrain data check <dataset|card|file> [--model M] [--json]
                                                 validate a dataset against its card before training
    posttrain plan <config.json|model dir|hub id> [--json] [--gpus N --gpu-mem GB ...]
                                                 capacity planner: parameters, memory, KV cache, speed ceiling
"""

from __future__ import annotations

import logging
import os
import sys

from posttrain import template_cli
from posttrain.artifacts import ArtifactError
from posttrain.chat.render import MaskError
from posttrain.config import RecipeError, compose
from posttrain.data import check_cli
from posttrain.data.dolly import DataError
from posttrain.evaluation import claims
from posttrain.evaluation import run as evaluation
from posttrain.pipeline import run_pipeline, run_single_stage
from posttrain.planner import cli as planner_cli
from posttrain.preflight import preflight
from posttrain.serve import server

USAGE = __doc__
# Loggers whose INFO / WARNING lines say nothing a user can act on: bitsandbytes warns at import, on CPUs with
# AVX512-BF16, that the optional `kernels` package (a faster 4-bit CPU kernel) is missing.
QUIET_LOGGERS = {"bitsandbytes.backends.cpu.ops": logging.ERROR}
# The extra (pyproject.toml's optional-dependencies) that installs each optional top-level module: a command that
# reaches one on an install without it stops with the pip line that adds it, not a traceback.
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "uvloop": "serve", "httptools": "serve",
          "prometheus_client": "serve", "openai": "serve", "deepspeed": "deepspeed", "wandb": "wandb", "gguf": "gguf",
          "compressed_tensors": "quant", "matplotlib": "report", "if_verifiable": "ifeval", "nltk": "ifeval",
          "langdetect": "ifeval", "immutabledict": "ifeval", "bitsandbytes": "gpu", "triton": "gpu",
          "lm_eval": "lmeval"}


def setup_logging() -> None:
    """posttrain's INFO lines on stderr; the HTTP stack's per-request lines (the eval client's httpx, the in-process
    server's uvicorn) and the QUIET_LOGGERS above held back."""
    logging.basicConfig(level=logging.INFO, format="[posttrain %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    server.quiet_http_logs()
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def main(argv: list[str] | None = None) -> int:
    try:
        return run_command(list(sys.argv[1:] if argv is None else argv))
    except ModuleNotFoundError as err:
        extra = EXTRAS.get((err.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"posttrain: error: this needs {err.name}, which the `{extra}` extra installs: "
              f"pip install 'posttrain[{extra}]' (or 'posttrain[all]')", file=sys.stderr)
        return 2


def run_command(argv: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "serve":
        if argv[1:2] in (["-h"], ["--help"]):
            print(server.USAGE)
            return 0
        return server.main(argv[1:])
    if argv[0] == "plan":
        return planner_cli.main(argv[1:])
    if argv[:2] == ["data", "check"]:
        return check_cli.main(argv[2:])
    if argv[:2] in (["template", "render"], ["template", "cost"]):
        return template_cli.main(argv[2:], argv[1])

    dry_run = "--dry-run" in argv
    argv = [arg for arg in argv if arg != "--dry-run"]
    command, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    if command not in (None, "run", "eval", "claims"):
        print(f"posttrain: unknown command '{command}'\n{USAGE}", file=sys.stderr)
        return 2
    known = (RecipeError, ArtifactError, DataError, MaskError, FileNotFoundError, claims.ClaimsError)
    try:
        cfg = compose(overrides)
        if dry_run and (command == "run" or cfg.stage):
            checked = preflight(cfg, list(cfg.pipeline.stages) if command == "run" else [cfg.stage])
            print("posttrain: the recipe composes, and these hold before any stage would run:\n  "
                  + "\n  ".join(["recipe keys and value types", *checked]))
            return 0
        if command == "run":
            run_pipeline(cfg)
        elif command == "eval":
            evaluation.main(cfg, overrides)
        elif command == "claims":
            return claims.main(cfg)
        elif cfg.stage:
            run_single_stage(cfg)
        else:
            print("posttrain: give a command (run) or stage=<name>\n" + USAGE, file=sys.stderr)
            return 2
    except known as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
