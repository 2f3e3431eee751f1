"""The `posttrain` command.

    posttrain run pipeline=tiny [overrides]      run a pipeline (Hydra overrides as in any Hydra app); with
                                                 --dry-run, only check what can be checked before it starts
    posttrain stage=sft model=... data=...       run one stage
    posttrain eval [run.name=<run>] [overrides]  serve each checkpoint of a run, score it through the API, write
                                                 scorecard.md/.json and report.html (default: the latest run)
    posttrain claims [run.name=<run>]            check the tiny world's claims on an evaluated run (exit 1: a
                                                 claim failed, named with what was measured and needed)
    posttrain serve <artifact|dir|hub id> [port=8000 api_key=... backend=posttrain|vllm ...]
                                                 the OpenAI-compatible server (posttrain serve --help)
    posttrain template render [--template ...]   print a rendered chat, its token count and control-token ids
    posttrain data check <dataset|card|file> [--model M] [--json]
                                                 validate a dataset against its card before training
    posttrain plan <config.json|model dir|hub id> [--json] [--gpus N --gpu-mem GB ...]
                                                 capacity planner: parameters, memory, KV cache, speed ceiling
"""

from __future__ import annotations

import logging
import os
import sys

USAGE = __doc__
# Loggers whose INFO / WARNING lines say nothing a user can act on: bitsandbytes warns at import, on CPUs with
# AVX512-BF16, that the optional `kernels` package (a faster 4-bit CPU kernel) is missing.
QUIET_LOGGERS = {"bitsandbytes.backends.cpu.ops": logging.ERROR}


def setup_logging() -> None:
    """posttrain's INFO lines on stderr; the HTTP stack's per-request lines (the eval client's httpx, the in-process
    server's uvicorn) and the QUIET_LOGGERS above held back."""
    from posttrain.evaluation.client import quiet_http_logs

    logging.basicConfig(level=logging.INFO, format="[posttrain %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    quiet_http_logs()
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "serve":
        from posttrain.serve.server import USAGE as SERVE_USAGE, main as serve_main

        if argv[1:2] in (["-h"], ["--help"]):
            print(SERVE_USAGE)
            return 0
        return serve_main(argv[1:])
    if argv[0] == "plan":
        from posttrain.planner.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:2] == ["data", "check"]:
        from posttrain.data.check_cli import main as check_main

        return check_main(argv[2:])
    if argv[:2] == ["template", "render"]:
        from posttrain.chat.cli import main as render_main

        return render_main(argv[2:])

    # Imported here, after the light subcommands above: those should not pay for torch, TRL and Hydra.
    from posttrain.artifacts import ArtifactError
    from posttrain.chat.render import MaskError
    from posttrain.config import RecipeError, compose
    from posttrain.data.dolly import DataError
    from posttrain.pipeline import run_pipeline, run_single_stage

    dry_run = "--dry-run" in argv
    argv = [arg for arg in argv if arg != "--dry-run"]
    command, overrides = (argv[0], argv[1:]) if argv and "=" not in argv[0] else (None, argv)
    if command not in (None, "run", "eval", "claims"):
        print(f"posttrain: unknown command '{command}'\n{USAGE}", file=sys.stderr)
        return 2
    from posttrain.evaluation.claims import ClaimsError

    known = (RecipeError, ArtifactError, DataError, MaskError, FileNotFoundError, ClaimsError)
    try:
        cfg = compose(overrides)
        if dry_run and (command == "run" or cfg.stage):
            from posttrain.preflight import preflight

            checked = preflight(cfg, list(cfg.pipeline.stages) if command == "run" else [cfg.stage])
            print("posttrain: the recipe composes, and these hold before any stage would run:\n  "
                  + "\n  ".join(["recipe keys and value types", *checked]))
            return 0
        if command == "run":
            run_pipeline(cfg)
        elif command == "eval":
            from posttrain.evaluation.run import main as eval_main

            eval_main(cfg)
        elif command == "claims":
            from posttrain.evaluation.claims import main as claims_main

            return claims_main(cfg)
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
