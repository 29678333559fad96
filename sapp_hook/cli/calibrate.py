"""`sapp-hook calibrate`: fit a time factor and a per-action overhead to runs `sapp-hook validate` measured."""

from __future__ import annotations

import argparse
from pathlib import Path

from basics.files import read_json
from sapp_hook.cli.common import command, configure_logging, finish, output_paths, read_profile, write_output
from solver.calibrate import calibrate

PROG = "sapp-hook calibrate"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="fit the profile's times and the engine's per-action overhead to measured runs",
        description=(
            "Fit a factor on every layer time and an overhead per action (forward, backward, weight "
            "gradient) by least squares on the relative error of each rank's step time in the runs given: "
            "reports of `sapp-hook validate --json`, planned from --profile (`validate --profile-out`). "
            "Plan again with the profile --profile-out writes and `solve --action-overhead`."
        ),
    )
    parser.add_argument("reports", nargs="+", metavar="REPORT", help="JSON reports of sapp-hook validate --json")
    parser.add_argument("--profile", required=True, metavar="FILE", help="the profile the runs were planned from")
    parser.add_argument("--profile-out", metavar="OUT", help="write the profile with its times scaled by the factor")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    from sapp_hook.validation.validate import measured_run

    configure_logging(not (args.json or args.quiet))
    outputs = output_paths(args, ("profile_out",))
    profile = read_profile(args.profile)
    runs = [measured_run(read_json(Path(path), "REPORT"), profile, where=path) for path in args.reports]
    fit = calibrate(runs)
    data = {
        "time_scale": fit.time_scale,
        "action_overhead_ms": fit.action_overhead_ms,
        "step_error_before": fit.error_before,
        "step_error_after": fit.error_after,
        "runs": len(runs),
    }
    written = []
    if "profile_out" in outputs:
        written.append(write_output(outputs, "profile_out", profile.with_times_scaled(fit.time_scale).save))
    solve_with = (
        f"--profile {outputs['profile_out']}"
        if "profile_out" in outputs
        else f"--profile PROFILE (the times x {fit.time_scale:.4g}: --profile-out writes it)"
    )
    report = "\n".join(
        [
            f"{len(runs)} run{'s' if len(runs) > 1 else ''}, {sum(len(run.measured_step_ms) for run in runs)} ranks",
            f"time factor        {fit.time_scale:.4g} (every layer time)",
            f"overhead           {fit.action_overhead_ms:.4g} ms per action",
            f"step-time error    {fit.error_before:.1%} -> {fit.error_after:.1%} (root mean square, relative)",
            f"plan again with    sapp-hook solve {solve_with} --action-overhead {fit.action_overhead_ms:.4g} ...",
        ]
    )
    return finish(args, data, report, written)
