"""Megatron-Core's pipeline layout string (`--pipeline-model-parallel-layout`): read by its grammar,
checked by the rules Megatron applies at launch, and written from a split.

The grammar, as `PipelineParallelLayerLayout.parse_str_to_list` reads it: commas are cosmetic and
dropped; `(...)*N` repeats a group (groups do not nest); then `x*N` repeats the one symbol before it;
`|` ends a stage; a stage holds `E` (embedding), `t` (decoder layer), `m` (multi-token-prediction
layer) and `L` (loss). Stages are in Megatron's order: virtual stage v of pipeline rank r is stage
v x pipeline size + r, which is also the order of the model's layers.

The rules (`validate_layer_layout` and `validate_args`): the stage count is a multiple of the pipeline
size (the virtual size is the quotient); the first layer is `E` and the last `L`, once each; the `t`
count is `--num-layers`; the `m` count is `--mtp-num-layers` (none without it); every `m` comes after
every `t`, sits in the last virtual stage of its rank, and all of them in one stage.
"""

from __future__ import annotations

from dataclasses import dataclass

EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
SYMBOLS = (EMBEDDING, DECODER, MTP, LOSS)
MAX_LAYERS = 1_000_000  # a layout spelling out more is refused before it is built


class LayoutError(Exception):
    """A layout Megatron-LM refuses; `detail` says which rule."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass(frozen=True)
class LayerLayout:
    stages: tuple[tuple[str, ...], ...]  # in the string's order
    pipeline_size: int

    @property
    def virtual_size(self) -> int:
        return len(self.stages) // self.pipeline_size

    def count(self, symbol: str) -> list[int]:
        return [stage.count(symbol) for stage in self.stages]


def parse_stages(text: str) -> list[list[str]]:
    """The layers of each stage of a layout string; LayoutError where Megatron could not read it."""
    expanded = _repeat_symbols(_repeat_groups(text.replace(",", "")))
    stages: list[list[str]] = [[]]
    for char in expanded:
        if char == "|":
            stages.append([])
        elif char in SYMBOLS:
            stages[-1].append(char)
        else:
            raise LayoutError(
                f"{text!r}: {char!r} is not a layer (E, t, m, L), a stage end (|), a repeat (*N) or a group ((...)*N)"
            )
    return stages


def check(text: str, *, pipeline_size: int, num_layers: int, mtp_layers: int | None) -> LayerLayout:
    """The layout if Megatron-LM runs it with these sizes; LayoutError naming the rule it breaks."""
    stages = parse_stages(text)
    if pipeline_size < 1 or len(stages) % pipeline_size:
        raise LayoutError(f"{text!r} has {len(stages)} stages, not a multiple of the pipeline size {pipeline_size}")
    layers = [symbol for stage in stages for symbol in stage]
    if not layers or layers[0] != EMBEDDING or layers.count(EMBEDDING) != 1:
        raise LayoutError(f"{text!r}: the first layer must be the embedding E, and E must appear once")
    if layers[-1] != LOSS or layers.count(LOSS) != 1:
        raise LayoutError(f"{text!r}: the last layer must be the loss L, and L must appear once")
    if layers.count(DECODER) != num_layers:
        raise LayoutError(f"{text!r} has {layers.count(DECODER)} decoder layers t; --num-layers is {num_layers}")
    expected_mtp = mtp_layers or 0
    if layers.count(MTP) != expected_mtp:
        raise LayoutError(f"{text!r} has {layers.count(MTP)} MTP layers m; --mtp-num-layers is {expected_mtp}")
    if MTP in layers and DECODER in layers[layers.index(MTP) :]:
        raise LayoutError(f"{text!r}: every decoder layer t must come before the MTP layers m")
    layout = LayerLayout(tuple(tuple(stage) for stage in stages), pipeline_size)
    last_virtual = layout.virtual_size - 1
    for index, stage in enumerate(layout.stages):
        if MTP in stage and (index // pipeline_size != last_virtual or stage.count(MTP) != expected_mtp):
            raise LayoutError(
                f"{text!r}: the MTP layers m must all be in one stage, the last virtual stage of "
                f"its pipeline rank (stage {index} is virtual stage {index // pipeline_size} of rank "
                f"{index % pipeline_size})"
            )
    return layout


def layout_text(stages: list[list[str]]) -> str:
    """A layout string for these stages: runs of three or more of a layer as `x*N`."""
    written = []
    for stage in stages:
        text = ""
        index = 0
        while index < len(stage):
            run = 1
            while index + run < len(stage) and stage[index + run] == stage[index]:
                run += 1
            text += f"{stage[index]}*{run}" if run >= 3 else stage[index] * run
            index += run
        written.append(text)
    return "|".join(written)


def _repeat_groups(text: str) -> str:
    out = []
    index = 0
    while index < len(text):
        if text[index] != "(":
            out.append(text[index])
            index += 1
            continue
        close = text.find(")", index)
        nested = text.find("(", index + 1)
        if close < 0 or (0 <= nested < close):
            raise LayoutError(f"{text!r}: a group ( at {index} is not closed before another opens (groups do not nest)")
        count, after = _count(text, close + 1)
        if count is None or close == index + 1:
            raise LayoutError(f"{text!r}: a group (...) must hold layers and be followed by *N")
        out.append(text[index + 1 : close] * count)
        index = after
    return "".join(out)


def _repeat_symbols(text: str) -> str:
    out = []
    index = 0
    while index < len(text):
        char = text[index]
        count, after = _count(text, index + 1)
        if count is not None and char != "*":
            out.append(char * count)
            index = after
        else:
            out.append(char)
            index += 1
    return "".join(out)


def _count(text: str, index: int) -> tuple[int | None, int]:
    """N of a `*N` at `index`, and where it ends."""
    if not text.startswith("*", index):
        return None, index
    end = index + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == index + 1:
        return None, index
    count = int(text[index + 1 : end])
    if count > MAX_LAYERS:
        raise LayoutError(f"{text!r}: *{count} repeats more than {MAX_LAYERS} times")
    return count, end
