"""How `sapp-hook run` and the `autotune` inside the job it launches talk: environment and exit status."""

# A job that wrote its plan exits with it for its launcher to restart it (EX_TEMPFAIL: "try again"), or, under
# `sapp-hook run`, which reads `planned_file`, with 0: torchrun tells of a worker's 75 as its own failure.
REPLAN_EXIT_CODE = 75
ON_PLAN = ("continue", "exit")
# `sapp-hook run` sets these for the training command it launches; they override the script's own choice.
# `planned_file`: rank 0 writes there what the job decided ({"config", "restart"}) once the plan is written,
# or why it ended before its plan ({"incomplete": why}).
ENVIRONMENT = {
    "config": "SAPP_HOOK_CONFIG",
    "target": "SAPP_HOOK_TARGET",
    "on_plan": "SAPP_HOOK_ON_PLAN",
    "cache_dir": "SAPP_HOOK_CACHE_DIR",
    "force": "SAPP_HOOK_FORCE",
    "planned_file": "SAPP_HOOK_PLANNED_FILE",
}


def installed_version() -> str:
    """sapp-hook's version as installed ("unknown" when run from a tree that is not): `--version`, and
    part of a cached plan's key (another release may measure or plan differently)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sapp-hook")
    except PackageNotFoundError:
        return "unknown"
