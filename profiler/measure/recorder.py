"""The hooks: marks at every layer boundary of a real training step, and what autograd keeps per layer.

A step's timeline, per micro-batch (the slots are the head, each body layer, the tail):

    forward:  model pre-hook | head | block 0 pre ... block 0 post | ... | block n post | tail (+ loss)
    backward: first grad_fn of the model's output | tail | block n output grad ... block n input grad | ...
              | block 0 input grad | head (until its parameters' gradients are accumulated)

Times come from marks at those points (`clock`), so every slot's interval is what ran between them. Memory
comes from a saved-tensor hook: each storage autograd saves is counted once per forward, for the slot that
saved it first, parameters and buffers excluded.

MTP blocks (kind `body:mtp`) run after the last decoder block, inside the tail's windows: they are timed
by their own marks, which the tail's times leave out; each one's backward ends when its share of its
input's gradient is formed (a view of the input it is handed), and its work never runs under recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from basics.errors import InputError
from profiler.layers import Block
from profiler.measure.clock import DeviceMemory, EventClock, WallClock
from profiler.measure.tensors import (
    _detached,
    _input_tensor,
    _output_tensor,
    _tensor_bytes,
    _unpack,
    _without_cache,
    storage_key,
    unique_bytes,
)
from profiler.recompute import set_recompute
from profiler.tp_roles import Owners, tagged
from solver.vocabulary.profile import MTP_KIND, NONE

log = logging.getLogger(__name__)

HEAD, TAIL = "head", "tail"  # slot names next to the body layers' indices
FORWARD, BACKWARD = "forward", "backward"


@dataclass
class Pass:
    """One micro-batch through one slot."""

    mode: str
    forward_start: object = None
    forward_end: object = None
    backward_start: object = None
    backward_end: object = None
    parameter_marks: list[object] = field(default_factory=list)  # gradients of the slot's parameters accumulated
    kept_bytes: dict[int, int] = field(default_factory=dict)  # storage -> bytes kept for backward
    roles: dict[int, str] = field(default_factory=dict)  # storage -> what tensor parallelism does to it (tp_roles)
    input_bytes: int = 0  # the activation a block receives (its gradient flows back out of the block)
    input_key: int | None = None  # the storage of that activation (kept_bytes says whether the layer saved it)
    shared_keys: frozenset[int] = frozenset()  # storages of the other tensors it is handed (rotary tables)
    backward_base_bytes: int = 0
    backward_peak_bytes: int | None = (
        None  # allocator peak over the backward, above its start (memory steps on the CPU)
    )
    # per phase ("forward", "backward"): collectives a pipeline runs once a step, left out of the layer's times
    step_collective_ms: dict[str, float] = field(default_factory=dict)
    nested: list[Pass] = field(default_factory=list)  # the tail's: MTP passes run inside its windows


@dataclass
class _Forward:
    """One forward call of the model: its passes and the storages already counted."""

    passes: dict[object, Pass]
    current: object
    counted: set[int] = field(default_factory=set)
    backward_started: bool = False


@dataclass
class Structure:
    """What the warm-up step found: the order blocks run in and which slot owns each parameter."""

    body_order: list[int] = field(default_factory=list)  # decoder blocks
    mtp_order: list[int] = field(default_factory=list)  # MTP blocks, the profile's last body layers
    module_slots: dict[int, object] = field(default_factory=dict)  # id(module) -> slot, for modules outside blocks
    slot_parameters: dict[object, list[nn.Parameter]] = field(default_factory=dict)  # every parameter a slot uses
    parameter_slots: dict[int, object] = field(default_factory=dict)  # id(param) -> the first slot that uses it

    @property
    def first_body(self) -> int:
        return self.body_order[0]

    @property
    def last_body(self) -> int:
        return self.body_order[-1]


class Recorder:
    """Installs the hooks on a model and collects passes; `LayerProfiler` drives it step by step."""

    def __init__(
        self,
        model: nn.Module,
        blocks: tuple[Block, ...],
        clock: WallClock | EventClock,
        memory: DeviceMemory | None,
        count_memory: bool = True,
    ) -> None:
        self.model = model
        self.count_memory = count_memory
        self.blocks = blocks
        self.mtp = {index for index, block in enumerate(blocks) if block.kind == MTP_KIND}
        self.clock = clock
        self.memory = memory
        self.structure = Structure()
        self.passes: list[tuple[object, Pass]] = []  # this step's, in the order they started
        self.mode = NONE
        self.recording = False
        self.running: tuple[Pass, str] | None = None  # in recorded steps: the pass running now and its phase
        self.has_head = self.has_tail = False
        self._forward: _Forward | None = None
        self._in_backward: dict[object, Pass] = {}
        self._resume: dict[int, tuple[object, tuple[Pass, str] | None]] = {}  # MTP block -> what ran before it
        self._memory_window: Pass | None = None  # the layer whose backward the allocator's peak is read for
        self._read_on_close = True  # False for the head's window, read at each of its gradients instead
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._discovery_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._undo_recompute: list[Callable[[], None]] = []
        self._body_started = -1  # discovery: index of the last block that ran in this forward, -1 before any
        self._runs_in_forward: dict[int, int] | None = None  # block index -> runs, while the model's forward runs
        self._repeated: set[int] = set()  # blocks that ran twice in one forward of the model
        self._excluded_storages: set[int] = set()  # parameters and buffers: not activations
        self.owners: Owners | None = None  # the modules running, for tp_roles (Llama-family models)
        self.gradient_bytes: dict[int, int] = {}  # id(param) -> bytes of its .grad
        self.optimizer_bytes: dict[int, int] = {}  # id(param) -> bytes of its optimizer state
        self.captured_inputs: dict[int, tuple[tuple, dict]] = {}  # body index -> (args, kwargs), for split_backward
        self.capture_for: set[int] = set()
        self.captured_tail_input: torch.Tensor | None = None  # the last block's output, for the tail's split_backward
        self.capture_tail = False
        self.input_shape: tuple[int, ...] | None = None  # of the model's first tensor input (token ids)
        self.output_bytes: list[int] = []  # per recorded forward: what the model returns that has a gradient
        self.loss_bytes: list[int] = []  # per recorded forward: of those, the scalars (its loss)
        self.forwards = 0  # of the model, since attached: a training step runs one at least
        self.optimizer_steps = 0  # since attached

    # -- installing and removing ------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._excluded_storages = {storage_key(t)[0] for t in [*self.model.parameters(), *self.model.buffers()]}
        add = self._handles.append
        # first among a module's hooks: what others do there (FSDP's gathers) counts in the layer's time
        add(self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True, prepend=True))
        add(self.model.register_forward_hook(self._model_post))
        for index, block in enumerate(self.blocks):
            add(block.module.register_forward_pre_hook(self._block_pre(index), with_kwargs=True, prepend=True))
            add(block.module.register_forward_hook(self._block_post(index), prepend=True))
        for param in self.model.parameters():
            if param.requires_grad:
                add(param.register_post_accumulate_grad_hook(self._gradient_accumulated))
        if optimizer is not None:
            add(optimizer.register_step_post_hook(self._optimizer_stepped))
        inside_blocks = self._inside_blocks()
        for module in self.model.modules():
            if id(module) not in inside_blocks and any(True for _ in module.parameters(recurse=False)):
                self._discovery_handles.append(module.register_forward_pre_hook(self._owner_pre(module)))
        if self.count_memory:
            if tagged(self.model):
                self.owners = Owners(self.model, storage_key)
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_hooks.__enter__()

    def detach(self) -> None:
        """Remove every hook and restore every forward; safe to call twice."""
        self.set_mode(NONE)
        for handle in self._handles + self._discovery_handles:
            handle.remove()
        self._handles.clear()
        self._discovery_handles.clear()
        if self.owners is not None:
            self.owners.remove()
            self.owners = None
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._forward = None
        self._in_backward.clear()
        self._memory_window = None
        self.running = None

    def finish_discovery(self) -> None:
        """After the warm-up: fix the order the blocks ran in and who owns each parameter."""
        for handle in self._discovery_handles:
            handle.remove()
        self._discovery_handles.clear()
        ran = {*self.structure.body_order, *self.structure.mtp_order}
        missing = [b.name for i, b in enumerate(self.blocks) if i not in ran]
        if missing:
            raise InputError("layers", f"never ran in the warm-up step: {', '.join(missing)}")
        if self._repeated:
            names = ", ".join(self.blocks[i].name for i in sorted(self._repeated))
            raise InputError(
                "layers",
                f"ran more than once in one forward of the model: {names}; a pipeline splits "
                "blocks that each run once per forward (one block's weights cannot serve "
                "layers on two stages)",
            )
        structure = self.structure
        last = structure.last_body if structure.body_order else None  # a pipeline part may hold no block
        for index, block in enumerate(self.blocks):
            structure.slot_parameters[index] = list(block.module.parameters())
        inside_blocks = self._inside_blocks()
        for module in self.model.modules():
            own = list(module.parameters(recurse=False))
            if not own or id(module) in inside_blocks:
                continue
            slot = structure.module_slots.get(id(module))
            if slot is None:
                log.warning(
                    "%s never ran in the warm-up step; its parameters count with the head", type(module).__name__
                )
                slot = HEAD
            elif slot == ("after", last):
                slot = TAIL
            elif isinstance(slot, tuple):  # ran between two blocks: counted with the earlier one
                slot = slot[1]
            structure.slot_parameters.setdefault(slot, []).extend(own)
        order = [HEAD, *structure.body_order, *structure.mtp_order, TAIL]
        for slot in order:
            for param in structure.slot_parameters.get(slot, []):
                structure.parameter_slots.setdefault(id(param), slot)
        self.has_head = HEAD in structure.slot_parameters
        self.has_tail = TAIL in structure.slot_parameters

    def _inside_blocks(self) -> set[int]:
        return {id(m) for block in self.blocks for m in block.module.modules()}

    def set_mode(self, mode: str, on_kept: bool = False) -> None:
        """Run every block under recompute `mode` from the next forward on."""
        for undo in self._undo_recompute:
            undo()
        self._undo_recompute = [
            set_recompute(
                block.module,
                NONE if index in self.mtp else mode,  # frameworks recompute no MTP layer
                self._kept_by(index) if on_kept and self.count_memory else None,
            )
            for index, block in enumerate(self.blocks)
        ]
        self.mode = mode

    # -- forward ----------------------------------------------------------------------------------

    def _model_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.forwards += 1
        self._body_started = -1
        if self.owners is not None:
            self.owners.reset()
        self._runs_in_forward = {}
        if self.input_shape is None:
            first = next((v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)), None)
            self.input_shape = tuple(first.shape) if first is not None else ()
        if not self.recording:
            return
        passes = {HEAD: Pass(self.mode, forward_start=self.clock.mark())} if self.has_head else {}
        self._forward = _Forward(passes=passes, current=HEAD)
        self.running = (passes[HEAD], FORWARD) if passes else None
        self._add_passes(passes)

    def _block_pre(self, index: int) -> Callable:
        mtp = index in self.mtp

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            order = self.structure.mtp_order if mtp else self.structure.body_order
            if index not in order:
                order.append(index)
            if self._runs_in_forward is not None:
                self._runs_in_forward[index] = self._runs_in_forward.get(index, 0) + 1
                if self._runs_in_forward[index] > 1:
                    self._repeated.add(index)
            if not mtp:  # what runs inside an MTP block (the shared LM head) stays the tail's
                self._body_started = index
            forward = self._forward
            if not self.recording or forward is None:
                return None
            if mtp:
                return self._mtp_pre(index, forward, args, kwargs)
            now = self.clock.mark()
            head = forward.passes.get(HEAD) if index == self.structure.first_body else None
            if head is not None:
                head.forward_end = now
            step = Pass(self.mode, forward_start=now)
            self._start_forward(index, forward, step, args, kwargs)
            block_input = _input_tensor(args, kwargs)
            if block_input is not None:
                step.input_key, step.input_bytes = storage_key(block_input)
                block_input.register_hook(self._input_grad(step, head))
            step.shared_keys = frozenset(
                storage_key(t)[0]
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t is not block_input
            )
            return None

        return hook

    def _mtp_pre(self, index: int, forward: _Forward, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """An MTP block's pass, nested in the tail's; it is handed a view of its input, whose gradient is its
        share of the input's (the input's own gradient waits for the tail's share too)."""
        step = Pass(NONE, forward_start=self.clock.mark())
        self._resume[index] = (forward.current, self.running)
        tail = forward.passes.get(TAIL)
        if tail is not None:
            tail.nested.append(step)
        self._start_forward(index, forward, step, args, kwargs)
        block_input = _input_tensor(args, kwargs)
        if block_input is None:
            return None
        view = block_input.view_as(block_input)
        step.input_key, step.input_bytes = storage_key(view)
        view.register_hook(self._mtp_input_grad(index, step))
        args = tuple(view if value is block_input else value for value in args)
        return args, {key: view if value is block_input else value for key, value in kwargs.items()}

    def _start_forward(self, index: int, forward: _Forward, step: Pass, args: tuple, kwargs: dict) -> None:
        """`step` is block `index`'s pass in `forward` and the one running; its input kept where asked."""
        forward.passes[index] = step
        forward.current = index
        self.running = (step, FORWARD)
        self._add_passes({index: step})
        if index in self.capture_for and index not in self.captured_inputs:
            self.captured_inputs[index] = _detached(args), _detached(_without_cache(kwargs))

    def _block_post(self, index: int) -> Callable:
        mtp = index in self.mtp

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if not mtp:
                self._body_started = index
            forward = self._forward
            if not self.recording or forward is None or index not in forward.passes:
                return
            now = self.clock.mark()
            step = forward.passes[index]
            step.forward_end = now
            if mtp:
                forward.current, self.running = self._resume.pop(index, (TAIL, None))
                block_output = _output_tensor(output)
                if block_output is not None:
                    block_output.register_hook(self._mtp_output_grad(index, step))
                return
            tail = None
            self.running = None
            if index == self.structure.last_body and self.has_tail:
                tail = Pass(self.mode, forward_start=now)
                forward.passes[TAIL] = tail
                forward.current = TAIL
                self._add_passes({TAIL: tail})
                self.running = (tail, FORWARD)
            block_output = _output_tensor(output)
            if block_output is not None:
                if tail is not None:
                    tail.input_key = storage_key(block_output)[0]
                if tail is not None and self.capture_tail and self.captured_tail_input is None:
                    self.captured_tail_input = _detached(block_output)
                block_output.register_hook(self._output_grad(step, index, tail))

        return hook

    def _model_post(self, module: nn.Module, args: tuple, output: object) -> None:
        self._runs_in_forward = None  # recompute re-runs blocks in the backward: not counted
        forward = self._forward
        if forward is None:
            return
        started = self._backward_started(forward)
        returned = []
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(started)
                returned.append(tensor)
        if self.recording:
            self.output_bytes.append(unique_bytes(returned))
            self.loss_bytes.append(unique_bytes([tensor for tensor in returned if tensor.dim() == 0]))

    def _owner_pre(self, module: nn.Module) -> Callable:
        def hook(mod: nn.Module, args: tuple) -> None:
            slot: object = HEAD if self._body_started < 0 else ("after", self._body_started)
            self.structure.module_slots.setdefault(id(module), slot)

        return hook

    # -- backward ---------------------------------------------------------------------------------

    def _backward_started(self, forward: _Forward) -> Callable:
        def hook(grad_outputs: tuple) -> None:
            if forward.backward_started:
                return
            forward.backward_started = True
            if self._forward is forward:
                self._forward = None  # nothing saved from here on belongs to this forward
            tail = forward.passes.get(TAIL)
            if tail is not None:  # the loss and LM head's backward: its window closed by the last block's
                tail.forward_end = self.clock.mark()
                self._start_backward(TAIL, tail, tail.forward_end)

        return hook

    def _output_grad(self, step: Pass, index: int, tail: Pass | None) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            now = self.clock.mark()
            if tail is not None:
                tail.backward_end = now
            later = self.running[0] if self.running is not None and self.running[1] == BACKWARD else None
            if later is not None and later.backward_end is None:  # ends where this one starts: what runs
                later.backward_end = now  # between (FSDP's gathers for this one) is this one's
            self._start_backward(index, step, now)

        return hook

    def _mtp_output_grad(self, index: int, step: Pass) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self._resume[index] = (TAIL, self.running)
            self._start_backward(index, step, self.clock.mark())

        return hook

    def _start_backward(self, key: object, step: Pass, now: object) -> None:
        """`step`'s backward starts at `now` (a clock mark): it is the one running, and its memory window opens."""
        step.backward_start = now
        self._in_backward[key] = step
        self.running = (step, BACKWARD)
        if self.memory is not None:
            self._open_memory_window(step)

    def _mtp_input_grad(self, index: int, step: Pass) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            step.backward_end = self.clock.mark()
            _, resumed = self._resume.pop(index, (TAIL, None))
            self.running = resumed
            if self.memory is not None:
                self._close_memory_window(step)
                if resumed is not None and resumed[1] == BACKWARD:  # the tail's window goes on
                    self._open_memory_window(resumed[0])

        return hook

    def _input_grad(self, step: Pass, head: Pass | None) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            now = self.clock.mark()
            if step.backward_end is None:
                step.backward_end = now
            if self.memory is not None:
                self._close_memory_window(step)
            if head is not None:
                head.backward_start = now
                self._in_backward[HEAD] = head
                self.running = (head, BACKWARD)
                # where no gradient lands through autograd (FSDP sets its shards' own), the backward's end ends it
                torch.autograd.Variable._execution_engine.queue_callback(self._head_backward_done(head))
                if self.memory is not None:  # no hook ends the embedding's backward: read as its gradients land
                    self._open_memory_window(head, read_on_close=False)

        return hook

    def _head_backward_done(self, head: Pass) -> Callable[[], None]:
        def callback() -> None:
            if not head.parameter_marks:
                head.backward_end = self.clock.mark()
            if self.running is not None and self.running[0] is head:
                self.running = None

        return callback

    def _open_memory_window(self, step: Pass, read_on_close: bool = True) -> None:
        """Start `step`'s backward memory window, closing the open one. A block's input is the block
        before's output: its gradient fires both blocks' hooks, the earlier block's first, so a window
        closes when the next one opens, reading the peak before the reset that starts the next."""
        self._close_memory_window()
        self.memory.reset_peak()
        step.backward_base_bytes = self.memory.allocated()
        self._memory_window, self._read_on_close = step, read_on_close

    def _close_memory_window(self, step: Pass | None = None) -> None:
        """Read the allocator's peak for the open window (only if it is `step`'s, when given)."""
        window = self._memory_window
        if window is None or (step is not None and window is not step):
            return
        if self._read_on_close:
            self._read_memory_window()
        self._memory_window = None

    def _read_memory_window(self) -> None:
        window = self._memory_window
        peak = self.memory.peak() - window.backward_base_bytes
        # a window reopened (the tail's, after an MTP block's backward) keeps its highest reading
        window.backward_peak_bytes = max(peak, window.backward_peak_bytes or peak)

    def _gradient_accumulated(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.gradient_bytes[id(param)] = _tensor_bytes(param.grad)
        slot = self.structure.parameter_slots.get(id(param))
        step = self._in_backward.get(slot)
        if self.recording and step is not None:
            step.parameter_marks.append(self.clock.mark())
            if step is self._memory_window and not self._read_on_close:
                self._read_memory_window()  # the head's: its peak so far, up to its last gradient
        # a gradient the backward creates stays for the step (static bytes), not in the layer's working set
        if self.memory is not None and param.grad is not None:
            self.memory.forget(param.grad)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.optimizer_steps += 1
        for group in optimizer.param_groups:
            for param in group["params"]:
                counted: set[int] = set()
                total = 0
                for value in optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        key, size = storage_key(value)
                        if key not in counted:
                            counted.add(key)
                            total += size
                self.optimizer_bytes[id(param)] = total

    # -- what autograd keeps ----------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        forward = self._forward
        if forward is not None:
            self._count(forward, forward.current, tensor)
        return tensor.detach()  # not the tensor itself: see profiler.measure.held

    def _kept_by(self, index: int) -> Callable[[torch.Tensor], None]:
        def kept(tensor: torch.Tensor) -> None:
            if self._forward is not None:
                self._count(self._forward, index, tensor)

        return kept

    def _count(self, forward: _Forward, slot: object, tensor: torch.Tensor) -> None:
        key, size = storage_key(tensor)
        if key in self._excluded_storages or key in forward.counted:
            return
        forward.counted.add(key)
        step = forward.passes.get(slot)
        if step is not None:
            step.kept_bytes[key] = size
            if self.owners is not None:
                step.roles[key] = self.owners.role(key, body=isinstance(slot, int))

    def _add_passes(self, passes: dict[object, Pass]) -> None:
        self.passes.extend(passes.items())
