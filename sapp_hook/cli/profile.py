"""`sapp-hook profile`: measure a model's layers in a few real training steps and write the profile."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from basics.units import format_bytes
from profiler.estimate.analytic import BYTES_PER_SECOND as BANDWIDTH
from profiler.estimate.analytic import FLOPS_PER_SECOND as FLOPS
from profiler.estimate.analytic import OPTIMIZER_BYTES_PER_PARAMETER as OPTIMIZER_BYTES
from profiler.estimate.collectives import Network
from profiler.estimate.conventions import CONVENTIONS, StaticConvention, convention
from sapp_hook.cli.common import (
    command,
    configure_logging,
    finish,
    mode_list,
    output_paths,
    write_output,
)
from sapp_hook.cli.flags import flag
from sapp_hook.pipelining.engine_rules import check_torch
from simulator import InputError
from solver.vocabulary.profile import NONE, ModelProfile

PROG = "sapp-hook profile"
STEPS, WARMUP_STEPS, MODES = 2, 1, "none,selective,full"
MEASURING = ("steps", "warmup_steps", "modes", "layers", "device")
LAYOUT = ("tensor_parallel", "sequence_parallel", "context_parallel", "expert_parallel", "expert_tokens")
NETWORK = (
    "link_bandwidth",
    "data_link_bandwidth",
    "link_latency",
    "data_parallel",
    "zero_stage",
    "fsdp",
    "reshard_after_forward",
)
# the layout a rank is measured on (D x T gloo processes) or estimated for
MESH = ("tensor_parallel", "sequence_parallel", "data_parallel", "fsdp", "reshard_after_forward")
ESTIMATING = tuple(
    name for name in ("flops", "bandwidth", "optimizer_bytes", "framework", *LAYOUT, *NETWORK) if name not in MESH
)
DTYPE = "float32"  # the parameters' dtype where neither --dtype nor --framework says


def add_parser(commands: argparse._SubParsersAction) -> None:
    from sapp_hook.models import BUILTIN_MODELS

    parser = commands.add_parser(
        "profile",
        help="measure every layer's time and memory, per recompute mode, in real training steps",
        description=(
            "Build a transformers model from its config with random weights (no download), train it for a "
            "few steps on random tokens and write what every layer costs: forward and backward time, "
            "activation bytes per recompute mode and what each mode adds, parameter, gradient and "
            "optimizer bytes. `sapp-hook solve --profile` reads the result. With --tensor-parallel or "
            "--data-parallel --fsdp, one rank of that mesh is profiled: the memory from one process, the "
            "times and each layer's collectives on D x T gloo processes. With --estimate, nothing "
            "runs: a Llama-family config's costs are estimated (times from FLOPs at --flops, memory as "
            "transformers' blocks keep it), for planning before the hardware is there."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}), a transformers config.json or a folder holding one",
    )
    parser.add_argument("--micro-batch-size", type=int, default=2, metavar="B", help="default 2")
    parser.add_argument("--seq-len", type=int, default=128, metavar="L", help="default 128")
    parser.add_argument(
        "--dtype",
        metavar="NAME",
        help=f"the parameters' dtype: {DTYPE} (default), bfloat16 or float16; with --framework, the compute "
        "dtype (default bfloat16)",
    )
    measured = parser.add_argument_group("measuring")
    measured.add_argument("--steps", type=int, metavar="N", help=f"measured steps per recompute mode (default {STEPS})")
    measured.add_argument(
        "--warmup-steps", type=int, metavar="N", help=f"steps before measuring (default {WARMUP_STEPS})"
    )
    measured.add_argument("--modes", metavar="LIST", help=f"recompute modes to measure (default {MODES})")
    measured.add_argument(
        "--layers",
        action="append",
        metavar="PATTERN",
        help="module-name pattern of the body blocks, e.g. 'model.layers.*' (repeatable; found automatically otherwise)",
    )
    measured.add_argument("--device", metavar="NAME", help="cpu (default), cuda, cuda:1, ...")
    estimated = parser.add_argument_group("estimating (--estimate)")
    estimated.add_argument(
        "--estimate",
        action="store_true",
        help="estimate a Llama-family config's costs instead of measuring (no torch needed)",
    )
    estimated.add_argument(
        "--flops",
        type=float,
        metavar="RATE",
        help=f"FLOP/s one device sustains: its peak times the utilisation expected (default {FLOPS:g})",
    )
    estimated.add_argument(
        "--bandwidth",
        type=float,
        metavar="RATE",
        help=f"bytes/s of device memory for elementwise work (default {BANDWIDTH:g})",
    )
    layout = parser.add_argument_group(
        "parallel layout (one rank, measured on D x T gloo processes as TorchTitan lays a Llama out, or estimated)"
    )
    flag("--tensor-parallel").add_to(layout, unset=True, help="one rank of a tensor-parallel job of N (default 1)")
    flag("--sequence-parallel").add_to(layout, unset=True, help="with --tensor-parallel: sequence parallel too")
    flag("--data-parallel").add_to(
        layout, unset=True, help="data-parallel replicas, for their collectives (default 1; solve shards memory)"
    )
    flag("--fsdp").add_to(layout, unset=True, help="torch FSDP2 over --data-parallel")
    flag("--reshard-after-forward").add_to(
        layout, unset=True, help="with --fsdp: gather the parameters again in every forward and backward"
    )
    flag("--context-parallel").add_to(estimated, unset=True, help="context-parallel degree (default 1)")
    flag("--expert-parallel").add_to(estimated, unset=True, help="expert-parallel degree (default 1)")
    flag("--expert-tokens").add_to(
        estimated,
        unset=True,
        help="token copies an expert-parallel rank receives: balanced (default), dropless or capacity:FACTOR",
    )
    flag("--zero-stage").add_to(estimated, unset=True, help="ZeRO stage, for its collectives")
    estimated.add_argument(
        "--link-bandwidth",
        type=float,
        metavar="RATE",
        help="bytes/s a rank's link moves within a node (tensor, context, expert parallel); "
        "with it each layer's collectives and their exposed time are estimated",
    )
    estimated.add_argument(
        "--data-link-bandwidth",
        type=float,
        metavar="RATE",
        help="bytes/s between nodes, where data parallelism runs (default --link-bandwidth)",
    )
    estimated.add_argument("--link-latency", type=float, metavar="SECONDS", help="per collective call (default 0)")
    estimated.add_argument(
        "--optimizer-bytes",
        type=float,
        metavar="N",
        help=f"optimizer state per parameter (default {OPTIMIZER_BYTES:g}: Adam's two fp32 states; "
        "12 with an fp32 master copy of 16-bit weights; with --framework, in place of its own)",
    )
    estimated.add_argument(
        "--framework",
        metavar="NAME",
        help="keep weights, gradients and optimizer state as this framework does: "
        f"{', '.join(CONVENTIONS)} (docs/cli.md lists the bytes a parameter of each); "
        "default: --dtype weights and gradients, --optimizer-bytes of optimizer state",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile JSON")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object on stdout")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.set_defaults(run=command(PROG, _run))


def _run(args: argparse.Namespace) -> int:
    talk = not (args.json or args.quiet)
    outputs = output_paths(args, ("out",))
    for name in MEASURING if args.estimate else ESTIMATING:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise InputError(flag, "is for measuring; --estimate runs nothing" if args.estimate else "needs --estimate")
    static = _static_memory(args)
    if args.dtype is None:
        args.dtype = DTYPE if static is None else static.compute_dtype
    if args.estimate:
        profile = _estimate(args, static)
    else:
        profile = _measure(args, talk)
    written = write_output(outputs, "out", profile.save)
    report = profile_report(profile) + ("" if static is None else "\n" + static.note())
    return finish(args, profile.to_dict(), report, [written])


def _static_memory(args: argparse.Namespace) -> StaticConvention | None:
    """--framework's bytes a parameter, with --optimizer-bytes in place of its optimizer state where given;
    None without --framework (the estimate keeps --dtype's weights and gradients, --optimizer-bytes of state)."""
    if args.framework is None:
        return None
    try:
        chosen = convention(args.framework)
    except InputError as exc:
        raise InputError("--framework", exc.detail) from None
    return chosen if args.optimizer_bytes is None else chosen.with_optimizer_bytes(args.optimizer_bytes)


def _estimate(args: argparse.Namespace, static: StaticConvention | None) -> ModelProfile:
    """profiler.estimate.analytic's estimate of the config at the flags' shape and throughputs; no torch."""
    from profiler.estimate.analytic import LLAMA_FAMILY, analytic_profile, shape_from_config
    from sapp_hook.models import config_data

    data, where = config_data(args.model)
    flags = {
        "sequence": "--seq-len",
        "micro_batch_size": "--micro-batch-size",
        "dtype": "--dtype",
        "flops_per_second": "--flops",
        "bytes_per_second": "--bandwidth",
        "optimizer_bytes_per_parameter": "--optimizer-bytes",
        "link_bytes_per_second": "--link-bandwidth",
        "data_link_bytes_per_second": "--data-link-bandwidth",
        "latency_s": "--link-latency",
        "fsdp_reshard_after_forward": "--reshard-after-forward",
        **{name: "--" + name.replace("_", "-") for name in (*LAYOUT, *NETWORK)},
    }
    layout = {name: getattr(args, name) for name in LAYOUT if getattr(args, name) is not None}
    if data.get("model_type") not in LLAMA_FAMILY:
        return _estimate_traced(args, data, where, static)
    try:
        shape = shape_from_config(
            data, sequence=args.seq_len, micro_batch_size=args.micro_batch_size, dtype=args.dtype, **layout
        )
        profile = analytic_profile(
            shape,
            flops_per_second=FLOPS if args.flops is None else args.flops,
            bytes_per_second=BANDWIDTH if args.bandwidth is None else args.bandwidth,
            optimizer_bytes_per_parameter=_optimizer_bytes(args, static),
            network=_network(args),
            static_memory=static,
        )
    except InputError as exc:
        if exc.field in flags:
            raise InputError(flags[exc.field], exc.detail) from None
        if exc.field.startswith("layers") or exc.field.endswith(("_bytes", "_ms")):  # what the estimate came to
            shape = f"--micro-batch-size {args.micro_batch_size:,}, --seq-len {args.seq_len:,}" + (
                f", --optimizer-bytes {args.optimizer_bytes:g}" if args.optimizer_bytes is not None else ""
            )
            raise InputError("--model", f"{where} at {shape}: the estimate's {exc.field}: {exc.detail}") from None
        raise InputError("--model", f"{where}: {exc.field}: {exc.detail}") from None
    return dataclasses.replace(profile, model=f"{where} (estimated)")


def _estimate_traced(args: argparse.Namespace, data: dict, where: str, static: StaticConvention | None) -> ModelProfile:
    """profiler.estimate.generic's estimate of a config outside the Llama family: the model built on the
    meta device and traced on fake tensors (needs torch and transformers, runs nothing real), for one
    rank of the flags' tensor, context and expert parallel layout."""
    for name in NETWORK:
        value = getattr(args, name)
        if value not in (None, False, 1):
            flag = "--" + name.replace("_", "-")
            raise InputError(
                flag,
                f"the traced estimate of {data.get('model_type')!r} states no collectives; leave {flag} out "
                "(solve --data-parallel and --zero-stage shard its memory)",
            )
    check_torch()
    import transformers

    from profiler.estimate.generic import traced_profile
    from solver.parallel.model_parallel import profile_for_mesh
    from solver.vocabulary.profile_parts import Mesh

    layout = {name: getattr(args, name) for name in LAYOUT if getattr(args, name) is not None}
    try:
        mesh = Mesh(**layout)
    except InputError as exc:
        raise InputError("--" + exc.field.removeprefix("mesh.").replace("_", "-"), exc.detail) from None
    transformers.logging.set_verbosity_error()  # the CLI owns the terminal
    flags = {"sequence": "--seq-len", "micro_batch_size": "--micro-batch-size", "dtype": "--dtype"}
    flags.update({name: "--" + name.replace("_", "-") for name in LAYOUT})
    try:
        profile = traced_profile(
            data,
            sequence=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            dtype=args.dtype,
            flops_per_second=FLOPS if args.flops is None else args.flops,
            bytes_per_second=BANDWIDTH if args.bandwidth is None else args.bandwidth,
            optimizer_bytes_per_parameter=_optimizer_bytes(args, static),
            static_memory=static,
        )
        profile = profile_for_mesh(profile, mesh)
    except InputError as exc:
        raise InputError(flags.get(exc.field, "--model"), f"{where}: {exc.field}: {exc.detail}") from None
    return dataclasses.replace(profile, model=f"{where} (estimated)")


def _optimizer_bytes(args: argparse.Namespace, static: StaticConvention | None) -> float:
    """What --optimizer-bytes gives, or the convention's, or the estimate's default."""
    if static is not None:
        return static.optimizer_bytes
    return OPTIMIZER_BYTES if args.optimizer_bytes is None else args.optimizer_bytes


def _network(args: argparse.Namespace) -> Network | None:
    """The links and data-parallel side the flags give; None where none is given (no collectives stated)."""
    if all(getattr(args, name) is None for name in NETWORK):
        return None
    given = {
        "link_bytes_per_second": args.link_bandwidth,
        "data_link_bytes_per_second": args.data_link_bandwidth,
        "latency_s": args.link_latency,
        "data_parallel": args.data_parallel,
        "zero_stage": args.zero_stage,
        "fsdp": args.fsdp,
        "reshard_after_forward": args.reshard_after_forward,
    }
    return Network(**{name: value for name, value in given.items() if value is not None})


def _measure(args: argparse.Namespace, talk: bool) -> ModelProfile:
    steps = STEPS if args.steps is None else args.steps
    warmup_steps = WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
    modes = mode_list(args.modes or MODES)
    for option, value in (("--steps", steps), ("--warmup-steps", warmup_steps)):
        if value < 1:
            raise InputError(option, f"expected an integer >= 1, got {value}")
    configure_logging(talk)
    check_torch()

    import torch
    import transformers

    from sapp_hook.models import load_config, profile_example

    torch.set_num_threads(1)  # see the README: two threads per process are far slower on small CPUs
    transformers.logging.set_verbosity_error()  # the CLI owns the terminal
    run = _mesh_run(args, steps, warmup_steps, modes)
    config = load_config(args.model)

    def progress(done: int, total: int, what: str) -> None:
        if talk:
            print(f"profiling: step {done}/{total} done ({what})", file=sys.stderr, flush=True)

    try:
        profile = profile_example(
            config,
            steps=steps,
            warmup_steps=warmup_steps,
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
            modes=modes,
            layers=args.layers,
            model_name=args.model,
            on_step=progress,
            device=_device(args.device or "cpu"),
            dtype=args.dtype,
        )
    except InputError as exc:
        if exc.field in ("modes", "layers"):
            raise InputError(f"--{exc.field}", exc.detail) from None
        raise
    if run is None:
        return profile
    from sapp_hook.validation.mesh_profile import profile_on_mesh

    return profile_on_mesh(run, profile)


def _mesh_run(args: argparse.Namespace, steps: int, warmup_steps: int, modes: tuple[str, ...]) -> object:
    """The mesh the flags ask one rank of measured on (checked before anything runs); None: one process."""
    if all(getattr(args, name) in (None, 1) for name in ("tensor_parallel", "data_parallel")) and not (
        args.sequence_parallel or args.fsdp or args.reshard_after_forward
    ):
        return None
    from sapp_hook.validation.mesh_profile import MeshRun, check_mesh_run

    if (args.device or "cpu") != "cpu":
        raise InputError("--device", "a mesh is measured on gloo processes on the CPU; expected cpu")
    if args.layers:
        raise InputError("--layers", "a mesh run finds the Llama family's blocks itself; leave it out")
    run = MeshRun(
        model=args.model,
        data_parallel=1 if args.data_parallel is None else args.data_parallel,
        tensor_parallel=1 if args.tensor_parallel is None else args.tensor_parallel,
        sequence_parallel=bool(args.sequence_parallel),
        fsdp=bool(args.fsdp),
        reshard_after_forward=bool(args.reshard_after_forward),
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        dtype=args.dtype,
        steps=steps,
        warmup_steps=warmup_steps,
        modes=modes,
    )
    check_mesh_run(run)
    return run


def _device(name: str) -> str:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError("--device", f"expected cpu, cuda or cuda:N, got {name!r}") from None
    if device.type != "cpu" and not (
        torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type
    ):
        raise InputError("--device", f"no {device.type} device here")
    return str(device)


def profile_report(profile: ModelProfile) -> str:
    """A table of the layers; runs of layers with equal numbers share one row."""
    modes = profile.modes
    batch = ", ".join(f"{k} {v}" for k, v in profile.micro_batch.items())
    rows: list[tuple[list[str], tuple]] = []
    for layer in profile.layers:
        cells = (
            layer.kind,
            f"{layer.forward_ms:.2f}",
            f"{layer.backward_ms:.2f}",
            format_bytes(layer.parameter_bytes),
            *(
                f"{format_bytes(layer.recompute[m].activation_bytes):>14} {layer.recompute[m].extra_ms:>7.2f}"
                if m in layer.recompute
                else f"{'-':>14} {'-':>7}"
                for m in modes
            ),
        )
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(layer.name)
        else:
            rows.append(([layer.name], cells))
    labels = [names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} (x{len(names)})" for names, _ in rows]
    name_width = max(6, *map(len, labels))
    kind_width = max(4, *(len(layer.kind) for layer in profile.layers))
    lines = [
        f"{profile.model}: {len(profile.layers)} layers, {profile.dtype}{' on ' + profile.device if profile.device else ''}, "
        f"micro-batch {batch}" + ("" if profile.mesh.is_one_d else f"; one rank of {profile.mesh.describe()}"),
        f"{'layers':<{name_width}}  {'kind':<{kind_width}}  {'fwd ms':>8} {'bwd ms':>8} {'params':>10} "
        + " ".join(f"{'act ' + mode:>14} {'+ms':>7}" for mode in modes),
    ]
    for label, (_, cells) in zip(labels, rows):
        kind, fwd, bwd, params, *per_mode = cells
        lines.append(
            f"{label:<{name_width}}  {kind:<{kind_width}}  {fwd:>8} {bwd:>8} {params:>10} " + " ".join(per_mode)
        )
    for tied in profile.tied_parameters:
        lines.append(
            f"tied            {' = '.join(tied.names)} ({format_bytes(tied.bytes)}), held by {', '.join(tied.layers)}"
        )
    body_modes = [m for m in modes if m != NONE]
    if body_modes:
        lines.append("act MODE: activation bytes kept per micro-batch; +ms: what the mode adds to forward+backward")
    lines.extend(collectives_report(profile))
    unmeasured = [
        name
        for name, degree in (("context", profile.mesh.context_parallel), ("expert", profile.mesh.expert_parallel))
        if degree > 1
    ]
    if unmeasured:
        lines.append(
            f"{' and '.join(unmeasured)} parallel: by rule, not measured on a run (torch 2.13 runs neither on a CPU)"
        )
    return "\n".join(lines)


def collectives_report(profile: ModelProfile) -> list[str]:
    """One line per mesh dimension and operation: the model's collectives, their time and what is exposed."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    for layer in profile.layers:
        for collective in layer.collectives:
            total = totals.setdefault((collective.dimension, collective.operation, collective.per), [0, 0.0, 0.0, 0.0])
            total[0] += collective.calls
            total[1] += collective.bytes
            total[2] += collective.ms
            total[3] += collective.exposed_ms
    lines = [
        f"collectives ({'in the forward and backward times' if per == 'micro-batch' else 'once a step, in no layer time'}): "
        f"{dimension} {operation} x{calls:.0f} per {per}, {format_bytes(moved)}, {ms:.2f} ms ({exposed:.2f} ms exposed)"
        for (dimension, operation, per), (calls, moved, ms, exposed) in totals.items()
    ]
    if not lines and not profile.mesh.is_one_d and profile.source == "analytic":
        lines.append("collectives: not estimated (give --link-bandwidth)")
    return lines
