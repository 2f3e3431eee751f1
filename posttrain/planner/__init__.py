"""The capacity planner: parameters, weight memory, KV cache, decode ceilings and training memory from a model's
config.json alone (`posttrain plan`, or `plan_model(load_config(source))` from Python).

Modules: config (load and normalise a config), params (the tensor inventory and counts), memory (formats, KV,
decode), training (full FT / LoRA / QLoRA under DDP and ZeRO), plan (the `Plan` and `verdict_line`), report (text
tables), cli.
"""

from posttrain.planner.config import Arch, PlannerError, load_config, parse_arch
from posttrain.planner.params import ParamCounts, count_params, inventory
from posttrain.planner.plan import Plan, plan_model, verdict_line

__all__ = ["Arch", "ParamCounts", "Plan", "PlannerError", "count_params", "inventory", "load_config", "parse_arch",
           "plan_model", "verdict_line"]
