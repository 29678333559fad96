"""The Megatron-LM flags a launch script passes: where each is (every live occurrence, those in
branches that may run included), and what value it has.

Flag names and arities are Megatron-LM's (`megatron/training/arguments.py`); argparse there has
`allow_abbrev=False`, so only whole names count, written `--flag value` or `--flag=value`.
"""

from __future__ import annotations

from dataclasses import dataclass

from basics.errors import InputError
from sapp_hook.writeback.text.bash_script import NOT_BLANK
from sapp_hook.writeback.text.provenance import Ch, Field, Reading, Site, part_of, text_of

SWITCH, ONE, MANY = 0, 1, -1
PP_SIZE = "--pipeline-model-parallel-size"
TP_SIZE = "--tensor-model-parallel-size"
CP_SIZE = "--context-parallel-size"
EP_SIZE = "--expert-model-parallel-size"
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"  # ZeRO-1: optimizer state sharded over data parallel
NUM_LAYERS = "--num-layers"
MTP_LAYERS = "--mtp-num-layers"
LAYOUT = "--pipeline-model-parallel-layout"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
GLOBAL_BATCH, MICRO_BATCH = "--global-batch-size", "--micro-batch-size"
RAMPUP = "--rampup-batch-size"  # start, increment, samples: the global batch grows to --global-batch-size
LAYERS_PER_VIRTUAL = "--num-layers-per-virtual-pipeline-stage"
VIRTUAL_STAGES = "--num-virtual-stages-per-pipeline-rank"
GROUP_SIZE = "--microbatch-group-size-per-virtual-pipeline-stage"
GRANULARITY, METHOD, RECOMPUTE_LAYERS = "--recompute-granularity", "--recompute-method", "--recompute-num-layers"
MODULES = "--recompute-modules"
RECOMPUTE_ACTIVATIONS = "--recompute-activations"
DISTRIBUTE = "--distribute-saved-activations"
GROUPED_GEMM = "--moe-grouped-gemm"
NO_OVERLAP_P2P = "--no-overlap-p2p-communication"
EMBEDDING_IN_SPLIT = "--account-for-embedding-in-pipeline-split"
LOSS_IN_SPLIT = "--account-for-loss-in-pipeline-split"
ENCODER_LAYERS, DECODER_LAYERS = "--encoder-num-layers", "--decoder-num-layers"  # T5's encoder-decoder stacks
# A Mamba hybrid model's layer mix (megatron/core/ssm/mamba_block.py); the pattern alone is HybridModel's
PATTERN = "--hybrid-layer-pattern"
HYBRID = ("--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern", PATTERN)

# Legacy recompute flags and what replaced them (Megatron-LM exits on --checkpoint-activations; the
# others are gone from its parser, which then refuses the script)
LEGACY = {
    "--checkpoint-activations": "--recompute-granularity full (with --recompute-method)",
    "--checkpoint-num-layers": "--recompute-num-layers",
    "--activations-checkpoint-method": "--recompute-method",
    "--activations-checkpoint-num-layers": "--recompute-num-layers",
    "--distribute-checkpointed-activations": DISTRIBUTE,
    "--moe-layer-recompute": "--recompute-granularity selective --recompute-modules moe",
}

# MindSpeed-LLM's own flags (mindspeed_llm/training/arguments.py and MindSpeed's features), read where a
# script is of that dialect (`writeback.mindspeed`)
NUM_LAYER_LIST = "--num-layer-list"  # decoder layers per pipeline rank, "17,20,22,21"
NOOP_LAYERS = "--noop-layers"  # ids (of --num-layers) of layers that do nothing
PIPELINE_NUM_LAYERS = "--pipeline-num-transformer-layers"  # "[[a,b],[c,d]]": per rank, per virtual stage
SCHEDULES_METHOD = "--schedules-method"  # dualpipev
FB_OVERLAP = "--moe-fb-overlap"
SWAP_ATTENTION, SWAP_MODULES = "--swap-attention", "--swap-modules"
PER_PP_RANK = "--enable-recompute-layers-per-pp-rank"
RECOMPUTE_ACTIVATION_FUNCTION = "--recompute-activation-function"
RECOMPUTE_ACTIVATION_LAYERS = "--recompute-activation-function-num-layers"
RECOMPUTE_NORM, RECOMPUTE_NORM_LAYERS = "--recompute-norm", "--recompute-norm-num-layers"
USE_MCORE, CKPT_FORMAT, LOAD = "--use-mcore-models", "--ckpt-format", "--load"
MINDSPEED_FLAGS = {
    NUM_LAYER_LIST: ONE,
    NOOP_LAYERS: ONE,
    PIPELINE_NUM_LAYERS: ONE,
    SCHEDULES_METHOD: ONE,
    FB_OVERLAP: SWITCH,
    SWAP_ATTENTION: SWITCH,
    SWAP_MODULES: ONE,
    PER_PP_RANK: SWITCH,
    RECOMPUTE_ACTIVATION_FUNCTION: SWITCH,
    RECOMPUTE_ACTIVATION_LAYERS: ONE,
    RECOMPUTE_NORM: SWITCH,
    RECOMPUTE_NORM_LAYERS: ONE,
    USE_MCORE: SWITCH,
    CKPT_FORMAT: ONE,
    LOAD: ONE,
}

FLAGS = {
    **MINDSPEED_FLAGS,
    PP_SIZE: ONE,
    TP_SIZE: ONE,
    CP_SIZE: ONE,
    EP_SIZE: ONE,
    DISTRIBUTED_OPTIMIZER: SWITCH,
    NUM_LAYERS: ONE,
    MTP_LAYERS: ONE,
    LAYOUT: ONE,
    FIRST: ONE,
    LAST: ONE,
    GLOBAL_BATCH: ONE,
    MICRO_BATCH: ONE,
    RAMPUP: MANY,
    LAYERS_PER_VIRTUAL: ONE,
    VIRTUAL_STAGES: ONE,
    GROUP_SIZE: ONE,
    GRANULARITY: ONE,
    METHOD: ONE,
    RECOMPUTE_LAYERS: ONE,
    MODULES: MANY,
    RECOMPUTE_ACTIVATIONS: SWITCH,
    DISTRIBUTE: SWITCH,
    GROUPED_GEMM: SWITCH,
    NO_OVERLAP_P2P: SWITCH,
    EMBEDDING_IN_SPLIT: SWITCH,
    LOSS_IN_SPLIT: SWITCH,
    "--multi-latent-attention": SWITCH,
    ENCODER_LAYERS: ONE,
    DECODER_LAYERS: ONE,
    **dict.fromkeys(HYBRID, ONE),
    "--checkpoint-activations": SWITCH,
    "--checkpoint-num-layers": ONE,
    "--activations-checkpoint-method": ONE,
    "--activations-checkpoint-num-layers": ONE,
    "--distribute-checkpointed-activations": SWITCH,
    "--moe-layer-recompute": SWITCH,
}


@dataclass(frozen=True)
class Occurrence:
    """One flag as a command gets it: the flag's field, its value fields (for `--flag=value` the
    characters after `=`), the command (index into Reading.commands; -1 for one found in another
    definition of a variable, which a branch may use instead), its place in the command's arguments."""

    flag: str
    name: Field
    values: tuple[Field, ...]
    command: int
    position: int
    inline: bool

    @property
    def alternative(self) -> bool:
        return self.command < 0

    def key(self) -> tuple[int, int]:
        """Where the flag is written: the same flag reached twice is one occurrence."""
        site = self.name[0].trail[-1] if self.name and self.name[0].trail else None
        return (site.file, site.start) if site else (-1, id(self))

    def value_text(self) -> str | None:
        """The value (a list's values joined by blanks); None for a switch or a value known only at launch."""
        texts = [text_of(value) for value in self.values]
        if not texts or any(text is None for text in texts):
            return None
        return " ".join(texts)  # type: ignore[arg-type]


def scan(fields: tuple[Field, ...], command: int) -> list[Occurrence]:
    """The known flags among a command's fields."""
    found = []
    for position, chars in enumerate(fields):
        text = text_of(chars)
        if text is None or not text.startswith("--"):
            continue
        flag, equals, _ = text.partition("=")
        if flag not in FLAGS:
            continue
        arity = FLAGS[flag]
        if equals:
            found.append(Occurrence(flag, chars, (part_of(chars, len(flag) + 1),), command, position, True))
            continue
        values: list[Field] = []
        if arity == ONE and position + 1 < len(fields):
            values.append(fields[position + 1])
        elif arity == MANY:
            for following in fields[position + 1 :]:
                following_text = text_of(following)
                if following_text is not None and following_text.startswith("-"):
                    break
                values.append(following)
        found.append(Occurrence(flag, chars, tuple(values), command, position, False))
    return found


def occurrences(reading: Reading, commands: list[int]) -> list[Occurrence]:
    """Every live occurrence of a known flag in these commands, and in the other definitions of the
    variables they expand, however deep (a branch's `opts="--recompute-activations"`), each once."""
    found: dict[tuple[int, int], Occurrence] = {}
    for index in commands:
        for occurrence in scan(reading.commands[index].argv, index):
            found.setdefault(occurrence.key(), occurrence)
    seen: set[int] = set()
    pending = _references(field for index in commands for field in reading.commands[index].argv)
    pending |= {ref for index in commands for ref in reading.commands[index].refs}
    done: set[int] = set()
    while pending:
        ref = pending.pop()
        done.add(ref)
        for number, definition in enumerate((reading.refs[ref].used, *reading.refs[ref].alternatives)):
            if definition < 0 or definition in seen:
                continue
            seen.add(definition)
            pending |= set(reading.definitions[definition].refs) - done
            value = reading.definitions[definition].value
            if value is None or number == 0:  # the definition used is in the command's arguments already
                continue
            for item in value.elements():
                fields = split_fields(item)
                for occurrence in scan(fields, -1):
                    found.setdefault(occurrence.key(), occurrence)
                pending |= _references(fields) - done
    return list(found.values())


def split_fields(chars: Field) -> tuple[Field, ...]:
    """A value split at blanks, as an unquoted expansion of it is."""
    fields: list[Field] = []
    current: list[Ch] = []
    for ch in chars:
        if ch.unknown:
            current.append(ch)
            continue
        position = 0
        for match in NOT_BLANK.finditer(ch.text):
            if match.start() > position and current:
                fields.append(tuple(current))
                current = []
            current.append(ch.cut(match.start(), match.end()))
            position = match.end()
        if position < len(ch.text) and current:
            fields.append(tuple(current))
            current = []
    if current:
        fields.append(tuple(current))
    return tuple(fields)


def _references(fields) -> set[int]:
    return {site.ref for chars in fields for ch in chars for site in ch.trail if site.ref >= 0}


@dataclass(frozen=True)
class FlagValue:
    """A flag's value as the script gives it: `text` (None where known only at launch), and what it
    depends on: variables set from the environment where the script is launched, or set differently
    in branches."""

    text: str | None
    environment: tuple[str, ...]
    branches: tuple[str, ...]
    conditional: bool  # the flag itself is written in a branch that may not run
    choices: tuple[str, ...] = ()  # where the value is one variable set in branches: what each sets
    exhaustive: bool = False  # ... and one of those branches always runs

    def number(self) -> int | None:
        return as_int(self.text)

    def determined(self) -> bool:
        return self.text is not None and not self.environment and not self.branches


def as_int(text: str | None) -> int | None:
    """`text` as Megatron-LM's argparse reads an int flag, None where it reads none."""
    if text is None or not text.isdecimal():
        return None
    try:
        return int(text)
    except ValueError:  # past Python's 4,300 digits
        return None


def value_of(reading: Reading, occurrence: Occurrence) -> FlagValue:
    text = occurrence.value_text()
    if text is not None and text.isdecimal() and as_int(text) is None:
        raise InputError(
            "--config", f"{occurrence.flag} is a number of {len(text):,} digits; Megatron-LM reads at most 4,300"
        )
    chars = tuple(ch for value in occurrence.values for ch in value)
    depth = written_depth(part_of(occurrence.name, 0, len(occurrence.flag)))
    environment: list[str] = []
    branches: list[str] = []
    for ch in chars:
        for site in ch.trail[depth or 0 :]:
            if site.ref < 0:
                continue
            ref = reading.refs[site.ref]
            if ref.state == "environment" and ref.name not in environment:
                environment.append(ref.name)
            elif ref.state == "ambiguous" and ref.name not in branches:
                branches.append(ref.name)
    choices, exhaustive = _choices(reading, chars, depth or 0)
    return FlagValue(
        text,
        tuple(environment),
        tuple(branches),
        conditional(reading, occurrence),
        choices,
        exhaustive,
    )


def _choices(reading: Reading, chars: Field, depth: int) -> tuple[tuple[str, ...], bool]:
    """The values a variable set in branches may give, where the whole value is that variable."""
    for level in range(depth, max((len(ch.trail) for ch in chars), default=0)):
        sites = {ch.trail[level] if len(ch.trail) > level else None for ch in chars}
        if len(sites) != 1 or None in sites:
            break
        site = sites.pop()
        if site is None or site.ref < 0 or reading.refs[site.ref].state != "ambiguous":
            continue
        ref = reading.refs[site.ref]
        definitions = [reading.definitions[index] for index in (ref.used, *ref.alternatives) if index >= 0]
        texts = [
            text_of(definition.value.scalar()) if definition.value is not None else None for definition in definitions
        ]
        exhaustive = bool(definitions) and not definitions[-1].conditional and None not in texts
        return tuple(dict.fromkeys(text for text in texts if text is not None)), exhaustive
    return (), False


def conditional(reading: Reading, occurrence: Occurrence) -> bool:
    """Whether the flag reaches its command only when a branch runs: it is written in a branch, or
    passed through a variable set in one (not counting `X="$X more"` in a branch, which keeps what X
    held before). The command's own place (a branch or not) does not count."""
    if occurrence.alternative:
        return True
    trail = occurrence.name[0].trail if occurrence.name else ()
    for site in trail[1:]:
        box = reading.boxes[site.box]
        appended = site.ref >= 0 and reading.refs[site.ref].name == box.name
        if box.conditional and not appended:
            return True
    return False


def written_depth(chars: Field) -> int | None:
    """The depth (in the characters' trails) at which these characters are all written as they
    are, in one place: None where they are not (built from variables, or known only at launch)."""
    trails = [ch.trail for ch in chars]
    if not trails or any(not trail or ch.unknown for trail, ch in zip(trails, chars)):
        return None
    depth = len(trails[0]) - 1
    first = trails[0][-1]
    for trail in trails:
        last = trail[-1]
        if (
            len(trail) != depth + 1
            or trail[:-1] != trails[0][:-1]
            or last.ref >= 0
            or (last.file, last.box) != (first.file, first.box)
        ):
            return None
    return depth


def sites_at(chars: Field, depth: int) -> list[Site] | None:
    """Each character's site at `depth`, or None where one has no site there."""
    sites = []
    for ch in chars:
        if len(ch.trail) <= depth:
            return None
        sites.append(ch.trail[depth])
    return sites
