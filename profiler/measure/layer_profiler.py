"""`LayerProfiler`: attach to a model, run a few real training steps, get a `ModelProfile`.

    with LayerProfiler(model, optimizer, steps=2) as profiler:
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()
            if profiler.done:
                break
    profile = profiler.profile()

The first `warmup_steps` steps warm up and find the layers' order; then each recompute mode runs
`steps` times, the modes taking turns so that drift in the machine's speed spreads over all of them.
On the CPU, which keeps no allocator counters, one more step per mode counts the bytes ops allocate
(`CpuMemory`) for each layer's backward working set; those steps are not timed.
Every block runs under the mode of its step (full or selective checkpointing), which leaves losses and
gradients bit-identical: checkpointing recomputes the same values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import torch
from torch import nn

from basics.errors import InputError
from profiler.layers import find_blocks
from profiler.measure.build import build_profile
from profiler.measure.clock import clock_for, device_of, memory_for
from profiler.measure.cpu_memory import CpuMemory
from profiler.measure.recorder import BACKWARD, FORWARD, TAIL, Pass, Recorder
from profiler.measure.samples import LayerSamples
from profiler.measure.split import SplitBackward, measure_split_backward
from profiler.parallel import holds_fsdp
from profiler.recompute import TORCH_MODES
from profiler.tp_roles import role_bytes
from solver.vocabulary.profile import NONE, ModelProfile

log = logging.getLogger(__name__)


class LayerProfiler:
    """Measures every layer's time and memory, per recompute mode, in the training steps the user runs.

    Attach it (`with`, or `attach()`), call `step()` after each training step until `done`, then take
    `profile()`. The first `warmup_steps` steps run without recompute and find the layers' order; then
    each mode in `modes` runs `steps` times, the modes taking turns (and, on the CPU, one more step per
    mode counts each backward's working set). Leaving the `with` block, or `detach()`, removes every hook.

    Attributes:
        blocks: the body layers found (`profiler.find_blocks`), in module order.
        steps_done: training steps seen so far; `total_steps` are needed, `done` says whether they ran.
        device: the device the model lies on.

    Raises:
        InputError: on construction, naming the argument: a step count below 1, `modes` without "none",
            repeated or not among "none", "selective", "full"; `model` without blocks to find.

    Example::

        with LayerProfiler(model, optimizer, steps=2) as profiler:
            for batch in batches:
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.step()
                if profiler.done:
                    break
        profile = profiler.profile()  # a solver.ModelProfile: profile.save("profile.json")
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        steps: int = 2,
        warmup_steps: int = 1,
        modes: Sequence[str] = TORCH_MODES,
        layers: Sequence[str] | None = None,
        mtp_layers: Sequence[str] | None = None,
        part: bool = False,
        pool: bool = True,
        split_backward: bool = True,
        tail: nn.Module | None = None,
        count_memory: bool = True,
        model_name: str = "",
        micro_batch: Mapping[str, int] | None = None,
        on_step: Callable[[int, int, str], None] | None = None,
    ) -> None:
        """Find the model's blocks; nothing is attached before `attach()` or `with`.

        Args:
            model: the model being trained.
            optimizer: its optimizer, whose state is counted per layer; None: no optimizer state.
            steps: measured steps per recompute mode (>= 1). Default 2.
            warmup_steps: steps before them (>= 1), which find the layers' order. Default 1.
            modes: the recompute modes to measure, "none" among them. Default none, selective, full.
            layers: module-name patterns (fnmatch) for the body blocks; None: found automatically.
            mtp_layers: module-name patterns (fnmatch) of multi-token-prediction modules, measured as body layers
                of kind "body:mtp" placed after the decoder blocks, without recompute (as MindFormers and
                Megatron-LM run them); a matched ModuleList stands for its children. None: the outermost modules
                whose own name starts with "mtp" (`mtp`, `model.mtp_layers`); (): none.
            part: `model` is a pipeline rank's part of a model, which may hold no block (found by `layers`).
            pool: give the layers of one kind their kind's median times.
            split_backward: time each body kind's backward split in two as torch's stages split it,
                once, alone, and count what is held between the halves.
            tail: the model's tail as a module from the last block's output to the loss (its final
                norm, LM head and loss), to split its backward too, on a copy of that output; None: the
                tail's backward is split in half by assumption and nothing is held between its halves.
            count_memory: count what autograd saves (off: times only, for the least overhead).
            model_name: the profile's model name; empty: the model's class name.
            micro_batch: the profile's micro-batch shape ({"size": 1, "sequence": 4096}); None: read
                from the model's input shape.
            on_step: `on_step(done, total, mode)`, progress after each step; None: none.
        """
        _check_count(steps, "steps", 1)
        _check_count(warmup_steps, "warmup_steps", 1)
        modes = tuple(modes)
        if NONE not in modes or len(set(modes)) != len(modes) or not set(modes) <= set(TORCH_MODES):
            raise InputError(
                "modes", f"expected distinct modes among {', '.join(TORCH_MODES)}, including none; got {modes}"
            )
        self.model = model
        self.optimizer = optimizer
        self.blocks = find_blocks(model, layers, part=part, mtp=mtp_layers)
        self.steps, self.warmup_steps, self.modes = steps, warmup_steps, modes
        self.pool, self.split_backward, self.tail = pool, split_backward, tail
        self.model_name = model_name or type(model).__name__
        self.micro_batch = dict(micro_batch) if micro_batch else None
        self.on_step = on_step
        self.device = device_of(model)
        self.recorder = Recorder(model, self.blocks, clock_for(self.device), memory_for(self.device), count_memory)
        # no allocator to read: working sets come from steps of their own, one per mode, counted op by op
        self._cpu_memory = CpuMemory() if count_memory and self.recorder.memory is None else None
        self.samples: dict[object, LayerSamples] = {}
        self.steps_done = 0
        self._attached = False
        self._seen_at_step = (0, 0)  # the recorder's forwards and optimizer steps at the last step()
        self._backward_splits: dict[str, SplitBackward] = {}

    @property
    def timed_steps_end(self) -> int:
        """The step after the last timed one: warm-up, then `steps` per mode."""
        return self.warmup_steps + self.steps * len(self.modes)

    @property
    def total_steps(self) -> int:
        return self.timed_steps_end + (len(self.modes) if self._cpu_memory is not None else 0)

    def is_memory_step(self, step: int) -> bool:
        """Whether step `step` (0-based) counts the CPU's allocations instead of being timed."""
        return self._cpu_memory is not None and step >= self.timed_steps_end

    def describe_step(self, step: int) -> str:
        """What step `step` (0-based) is for, for progress lines: "warm-up", "recompute full", ..."""
        if step < self.warmup_steps:
            return "warm-up"
        what = f"recompute {self.mode_of(step)}"
        return f"{what}, counting memory" if self.is_memory_step(step) else what

    @property
    def done(self) -> bool:
        return self.steps_done >= self.total_steps

    def mode_of(self, step: int) -> str:
        """The recompute mode step `step` (0-based) runs under; warm-up steps run without recompute."""
        if step < self.warmup_steps:
            return NONE
        if self.is_memory_step(step):
            return self.modes[step - self.timed_steps_end]
        return self.modes[(step - self.warmup_steps) % len(self.modes)]

    def __enter__(self) -> LayerProfiler:
        self.attach()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.detach()

    def attach(self) -> None:
        if self._attached or self.done:
            return
        self.recorder.attach(self.optimizer)
        self._attached = True
        counting = f" + {len(self.modes)} counting memory" if self._cpu_memory is not None else ""
        log.info(
            "profiling %d layers of %s: %d warm-up + %d x %d measured steps (%s)%s",
            len(self.blocks),
            self.model_name,
            self.warmup_steps,
            self.steps,
            len(self.modes),
            ", ".join(self.modes),
            counting,
        )

    @property
    def attached(self) -> bool:
        """Whether the hooks are on: between `attach()` (or `with`) and `detach()`."""
        return self._attached

    def detach(self) -> None:
        """Remove every hook and restore every block's forward; safe to call twice."""
        self._stop_counting()
        if self._attached:
            self.recorder.detach()
            self._attached = False

    def step(self) -> None:
        """Call once after each training step (after `optimizer.step()`).

        Raises:
            RuntimeError: while not attached (outside the `with` block), or where no training step ran since the
                last call (no forward of the model; no optimizer step, once the optimizer was seen stepping).
        """
        if not self._attached:
            raise RuntimeError(
                "LayerProfiler.step() outside the profiling window: use it inside `with LayerProfiler(...)`"
            )
        recorder = self.recorder
        self._check_one_step()
        recorder.clock.synchronize()
        mode = self.mode_of(self.steps_done)
        if self.is_memory_step(self.steps_done):
            self._stop_counting()
            self._collect_working_sets(mode)
        elif self.steps_done >= self.warmup_steps:
            self._collect(mode)
        recorder.passes.clear()
        self.steps_done += 1
        if self.steps_done == self.warmup_steps:
            recorder.finish_discovery()
        if self.on_step is not None:
            self.on_step(self.steps_done, self.total_steps, mode)
        if self.done:
            self.detach()
            self._measure_split_backward()
        else:
            self._start_step()

    def _check_one_step(self) -> None:
        """RuntimeError where `step()` ends no training step: no forward of the model since the last one, or
        (once the optimizer was seen stepping) no `optimizer.step()`: each profiled step would hold a part
        of a training step's work and memory, and the plan would be made from it."""
        recorder = self.recorder
        forwards, optimizer_steps = recorder.forwards, recorder.optimizer_steps
        last_forwards, last_optimizer_steps = self._seen_at_step
        self._seen_at_step = forwards, optimizer_steps
        if forwards == last_forwards:
            why = "the model ran no forward since the last call"
        elif last_optimizer_steps and optimizer_steps == last_optimizer_steps:
            why = "optimizer.step() ran not once since the last call (under gradient accumulation: call it after the step that updates the weights)"
        else:
            return
        raise RuntimeError(
            f"step() is called more than once per training step: {why}. Call it once after each "
            "training step, after optimizer.step(); nothing measured is used"
        )

    def profile(self) -> ModelProfile:
        """The measured profile; after the last profiled step.

        Returns:
            The `ModelProfile`: every layer's forward and backward time (ms), and per recompute mode
            what it keeps for backward and what the mode costs; parameter, gradient, optimizer bytes.

        Raises:
            RuntimeError: before every profiled step has run (`done`).
        """
        if not self.done:
            raise RuntimeError(
                f"profiled {self.steps_done} of {self.total_steps} steps; call step() after each training step"
            )
        return build_profile(
            self.recorder,
            self.samples,
            model=self.model,
            model_name=self.model_name,
            device=self.device,
            blocks=self.blocks,
            modes=self.modes,
            pool=self.pool,
            micro_batch=self.micro_batch,
            backward_splits=self.backward_splits,
        )

    def _start_step(self) -> None:
        recorder = self.recorder
        mode = self.mode_of(self.steps_done)
        recorder.recording = self.steps_done >= self.warmup_steps
        recorder.set_mode(mode, on_kept=True)
        if self.is_memory_step(self.steps_done):
            recorder.memory = self._cpu_memory
            self._cpu_memory.__enter__()
        last_plain_step = self.timed_steps_end - len(self.modes) + self.modes.index(NONE)
        if self.split_backward and self.steps_done == last_plain_step:
            first_of_kind = {}
            for index, block in enumerate(self.blocks):
                first_of_kind.setdefault(block.kind, index)
            recorder.capture_for = set(first_of_kind.values())
            recorder.capture_tail = self.tail is not None

    def _collect(self, mode: str) -> None:
        elapsed = self.recorder.clock.elapsed_ms
        for slot, record in self.recorder.passes:
            if record.forward_end is None or record.backward_start is None:
                continue  # a forward without backward (evaluation under no_grad)
            ends = [record.backward_end] if record.backward_end is not None else record.parameter_marks
            backward_ms = max((elapsed(record.backward_start, end) for end in ends), default=0.0)
            once = record.step_collective_ms  # what a pipeline runs once a step: not the layer's per micro-batch
            nested_ms = _nested_ms(record.nested, elapsed)
            # what a stage computes for all its blocks (the rotary tables) is kept by the first block
            # to save it: counted per stage (`ModelProfile.stage_shared_bytes`), not as that block's
            shared = sum(size for key, size in record.kept_bytes.items() if key in record.shared_keys)
            self.samples.setdefault(slot, LayerSamples()).add(
                record.mode,  # the step's, but an MTP block's always none
                forward_ms=elapsed(record.forward_start, record.forward_end) - once.get(FORWARD, 0.0) - nested_ms[0],
                backward_ms=backward_ms - once.get(BACKWARD, 0.0) - nested_ms[1],
                kept_bytes=sum(record.kept_bytes.values()) - shared,
                input_bytes=record.input_bytes,
                backward_peak_bytes=record.backward_peak_bytes,
                saved_input_bytes=record.kept_bytes.get(record.input_key, 0),
                shared_bytes=shared,
                parts=role_bytes(record.kept_bytes, record.roles, record.shared_keys) if self.recorder.owners else None,
            )

    def _collect_working_sets(self, mode: str) -> None:
        for slot, record in self.recorder.passes:
            if record.backward_peak_bytes is not None:
                self.samples.setdefault(slot, LayerSamples()).add_working_set(record.mode, record.backward_peak_bytes)

    def _stop_counting(self) -> None:
        """Leave a memory step's CpuMemory, if one is entered (the recorder reads it only then)."""
        if self._cpu_memory is not None and self.recorder.memory is self._cpu_memory:
            self._cpu_memory.__exit__(None, None, None)
            self.recorder.memory = None

    def _measure_split_backward(self) -> None:
        if holds_fsdp(self.model):  # FSDP's unsharding refuses a block's backward run alone: the split is assumed
            self.recorder.captured_inputs.clear()
            self.recorder.captured_tail_input = None
            return
        for index, (args, kwargs) in self.recorder.captured_inputs.items():
            block = self.blocks[index]
            measured = measure_split_backward(block.module, args, kwargs, self.device)
            if measured is not None:
                self._backward_splits[block.kind] = measured
        self.recorder.captured_inputs.clear()
        hidden = self.recorder.captured_tail_input
        if self.tail is not None and hidden is not None:
            measured = measure_split_backward(self.tail, (hidden,), {}, self.device)
            if measured is not None:
                self._backward_splits[TAIL] = measured
        self.recorder.captured_tail_input = None

    @property
    def backward_splits(self) -> dict[str, SplitBackward]:
        """Per body kind, and the tail where it was given: its backward split in two, measured alone."""
        return dict(self._backward_splits)


def _nested_ms(nested: list[Pass], elapsed: Callable[[object, object], float]) -> tuple[float, float]:
    """The forward and backward times of the MTP passes run inside the tail's windows: not the tail's."""
    forward = sum(elapsed(n.forward_start, n.forward_end) for n in nested if n.forward_end is not None)
    backward = sum(
        elapsed(n.backward_start, n.backward_end)
        for n in nested
        if n.backward_start is not None and n.backward_end is not None
    )
    return forward, backward


def _check_count(value: object, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(field, f"expected an integer >= {minimum}, got {value!r}")
