"""How `sapp-hook run` and the `autotune` inside the job it launches talk: environment and exit status."""

REPLAN_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", which is what the launcher should do
ON_PLAN = ("continue", "exit")
# `sapp-hook run` sets these for the training command it launches; they override the script's own choice.
# `planned_file`: rank 0 creates it once the plan is written, before the job exits with status 75, for
# launchers that do not pass that status on (torchrun exits with 1 when its workers exit with 75).
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
