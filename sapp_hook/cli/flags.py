"""The flags that fill a PipelineSpec, each declared once: its option, the spec field it fills, how argparse reads
it. Commands add the ones they take (`add_to`) and read them back (`spec_fields`); an error naming a field is
shown as the flag a user typed (`FIELD_FLAGS`). Flags renamed in this release keep their former names for one
more, with a warning (`RENAMED`, `translate_renamed`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

from basics.deprecation import renamed_message
from simulator import SCHEDULES


@dataclass(frozen=True)
class Flag:
    """One command-line flag for one PipelineSpec field.

    `kind` bool makes a switch (store_true); `negates`: the switch sets its field False
    (`--zero-grad-to-none` clears `gradients_persist`)."""

    option: str
    field: str
    help: str
    metavar: str | None = None
    kind: type = int
    default: object = None
    choices: tuple[object, ...] | None = None
    negates: bool = False

    @property
    def dest(self) -> str:
        """The argparse Namespace attribute: the option's name."""
        return self.option[2:].replace("-", "_")

    def add_to(
        self,
        parser: argparse.ArgumentParser | argparse._ActionsContainer,
        *,
        required: bool = False,
        unset: bool = False,
        help: str | None = None,
        choices: tuple[object, ...] | None = None,
    ) -> None:
        """Add the flag to `parser` (or an argument group). `unset`: its default is None, so a command can tell
        a flag left out from one given its default."""
        default = None if unset else self.default
        text = help or self.help
        if self.kind is bool:
            parser.add_argument(self.option, action="store_true", default=None if unset else False, help=text)
            return
        parser.add_argument(
            self.option,
            type=self.kind,
            metavar=self.metavar,
            default=default,
            required=required,
            choices=choices or self.choices,
            help=text,
        )

    def value(self, args: argparse.Namespace) -> object:
        """The spec field's value from parsed `args`."""
        given = getattr(args, self.dest)
        return (not given) if self.negates else given


PIPELINE_FLAGS = (
    Flag("--schedule", "schedule", f"one of: {', '.join(SCHEDULES)}", "NAME", str),
    Flag("--pipeline-parallel", "pipeline_parallel", "pipeline ranks (the pipeline-parallel degree)", "P"),
    Flag("--chunks", "chunks", "chunks (virtual stages) per rank; default: the schedule's", "V"),
    Flag("--micro-batches", "micro_batches", "micro-batches per step", "M"),
    Flag("--p2p", "p2p_ms", "ms to send one activation or gradient", "T", float, 0.0),
    Flag(
        "--microbatch-group-size",
        "microbatch_group_size",
        "Interleaved1F1B: Megatron's microbatch_group_size_per_vp_stage (default P, or what fits M)",
        "G",
    ),
)
PARALLEL_FLAGS = (
    Flag("--data-parallel", "data_parallel", "data-parallel replicas", "N", default=1),
    Flag(
        "--zero-stage",
        "zero_stage",
        "shard optimizer state (1), also gradients (2), also parameters (3) over --data-parallel",
        default=0,
        choices=(0, 1, 2, 3),
    ),
    Flag(
        "--fsdp",
        "fsdp",
        "torch FSDP2 (fully_shard) on each stage over --data-parallel, as TorchTitan runs it",
        kind=bool,
    ),
    Flag(
        "--reshard-after-forward",
        "fsdp_reshard_after_forward",
        "with --fsdp: free the gathered parameters after each forward (TorchTitan's PP default: not)",
        kind=bool,
    ),
    Flag("--tensor-parallel", "tensor_parallel", "tensor-parallel degree", "T", default=1),
    Flag(
        "--sequence-parallel",
        "sequence_parallel",
        "with --tensor-parallel: split the norms' and dropout's activations too",
        kind=bool,
    ),
    Flag("--context-parallel", "context_parallel", "context-parallel degree", "C", default=1),
    Flag("--expert-parallel", "expert_parallel", "expert-parallel degree", "E", default=1),
    Flag(
        "--expert-tokens",
        "expert_tokens",
        "token copies an expert-parallel rank receives: balanced, dropless or capacity:FACTOR",
        "RULE",
        str,
        "balanced",
    ),
    Flag("--ddp", "ddp", "torch DistributedDataParallel on each stage: its buckets copy the gradients", kind=bool),
    Flag(
        "--ddp-bucket-view",
        "ddp_bucket_view",
        "with --ddp: gradient_as_bucket_view=True, the gradients are the buckets",
        kind=bool,
    ),
    Flag(
        "--zero-grad-to-none",
        "gradients_persist",
        "zero_grad(set_to_none=True), TorchTitan's: gradients are freed between steps",
        kind=bool,
        negates=True,
    ),
    Flag(
        "--collective-backend",
        "collective_backend",
        "gloo's all-gathers hold a temporary of their output's size (default nccl)",
        kind=str,
        default="nccl",
        choices=("nccl", "gloo"),
    ),
)
BY_OPTION = {flag.option: flag for flag in (*PIPELINE_FLAGS, *PARALLEL_FLAGS)}
FIELD_FLAGS = {flag.field: flag.option for flag in (*PIPELINE_FLAGS, *PARALLEL_FLAGS)}

# Former flag names, kept for one release: old -> new.
RENAMED = {"--stages": "--pipeline-parallel", "--stage-constant": "--rank-constant"}
# The commands that take a renamed flag; `run` passes everything after its own flags to the job untouched.
TAKE_RENAMED = ("solve", "simulate", "validate")


def flag(option: str) -> Flag:
    return BY_OPTION[option]


def spec_fields(args: argparse.Namespace, flags: Iterable[Flag] = PARALLEL_FLAGS) -> dict[str, object]:
    """The PipelineSpec fields `flags` fill, from parsed `args`."""
    return {flag.field: flag.value(args) for flag in flags}


def translate_renamed(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`argv` with former flag names in their new names, a warning for each). Only a command that takes them
    is translated, and nothing after `--`."""
    command = next((word for word in argv if not word.startswith("-")), None)
    if command not in TAKE_RENAMED:
        return argv, []
    out, warnings, passed = [], [], False
    for word in argv:
        name, equals, value = word.partition("=")
        if not passed and name in RENAMED:
            warnings.append(renamed_message(name, RENAMED[name]))
            word = RENAMED[name] + equals + value
        passed = passed or word == "--"
        out.append(word)
    return out, warnings
