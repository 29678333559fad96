"""What each part of any transformers decoder keeps for backward and how many FLOPs its forward does,
found by running it on fake tensors (shapes without data, so a 671B model at its real sequence runs
in about a second) instead of a formula per family.

One forward of the model, cut to the fewest layers that hold each distinct layer kind, runs under
`FakeTensorMode` on the CPU's kernels (as `sapp-hook profile` measures), with:
- saved-tensor hooks: every tensor autograd keeps, attributed to the part (head, a layer, tail) that
  made it; a storage counted once; the parameters and what the head makes for all layers (rotary
  cos/sin, masks) apart (`shared_bytes`);
- a dispatch mode: what selective recompute keeps (`profiler.recompute.SELECTIVE_SAVE_OPS` outputs), the
  outputs of ops with a weight (their gradients are what a split backward holds, `pending_bytes`), and
  the widest such output (the backward's working gradients);
- `FlopCounterMode`, with the grouped expert matmul and the CPU attention kernel added (causal: half).
MoE routing runs as it is written: transformers' grouped-matmul experts have static shapes whatever the
routing, so every token copy is counted once (balanced or not, the totals are the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from basics.errors import InputError
from profiler.estimate.meta_model import decoder_parts
from profiler.recompute import SELECTIVE_SAVE_OPS

_aten = torch.ops.aten
_GROUPED_MM = getattr(_aten, "_grouped_mm", _aten.mm).default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PartTrace:
    """What one part (head, one decoder layer, tail) of one micro-batch's forward comes to."""

    saved_bytes: float = 0.0  # what autograd keeps (no recompute)
    saved_input_bytes: float = 0.0  # of it, the part's input hidden state itself
    selective_bytes: float = 0.0  # what selective recompute keeps beyond the input
    pending_bytes: float = 0.0  # outputs of ops with a weight
    widest_bytes: float = 0.0  # the largest output of an op with a weight
    forward_flops: float = 0.0
    weight_flops: float = 0.0  # of forward_flops, the matmuls with a weight (not attention)
    shared_bytes: float = 0.0  # head only: what it makes that every layer keeps (rotary cos/sin, masks)
    kind: str = ""
    _saved: set = field(default_factory=set, repr=False)
    _made: set = field(default_factory=set, repr=False)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """(tokens, k) x (experts, k, n) -> (tokens, n): each token row meets one expert's weight."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _cpu_attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    """QK^T and PV of SDPA's CPU kernel; causal attention does half."""
    b, heads, s_q, d_qk = q_shape
    s_k, d_v = k_shape[-2], v_shape[-1]
    flops = 2 * b * heads * s_q * s_k * (d_qk + d_v)
    return flops // 2 if (args[1] if len(args) > 1 else kwargs.get("is_causal", False)) else flops


def _flop_formulas() -> dict:
    formulas = {}
    if hasattr(_aten, "_grouped_mm"):
        formulas[_aten._grouped_mm] = _grouped_mm_flops
    if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[_aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_attention_flops
    return formulas


class _Recorder(TorchDispatchMode):
    """Attributes what each op makes to the part running now."""

    def __init__(self, parameters: set, current: list) -> None:
        super().__init__()
        self.parameters, self.current = parameters, current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
            # the CPU runs it in any dtype, its fake kernel checks for bf16: the output's shape is all we need
            output = args[0].new_empty((args[0].shape[0], args[1].shape[-1]))
        else:
            output = func(*args, **(kwargs or {}))
        part: PartTrace = self.current[-1]
        weighted = any(isinstance(a, torch.Tensor) and _key(a) in self.parameters for a in tree_leaves((args, kwargs)))
        for leaf in tree_leaves(output):
            if not isinstance(leaf, torch.Tensor):
                continue
            key = _key(leaf)
            if key in part._made or key in self.parameters:  # a view of a weight (its transpose)
                continue
            part._made.add(key)
            size = leaf.untyped_storage().nbytes()
            if func in SELECTIVE_SAVE_OPS:
                part.selective_bytes += size
            if weighted:
                part.pending_bytes += size
                part.widest_bytes = max(part.widest_bytes, size)
        return output


@contextlib.contextmanager
def _as_real_tensors() -> Iterator[None]:
    """transformers takes fake tensors for a compiler's trace and then builds attention masks and
    expands grouped key-value heads as it would under torch.compile; the estimate is of an eager run."""
    from transformers import masking_utils

    # one sequence a row, no padding: what the estimate feeds (reading the ids would need their values)
    with (
        mock.patch.object(masking_utils, "is_tracing", lambda tensor=None: False),
        mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None),
    ):
        yield


def _key(tensor: torch.Tensor) -> object:
    return StorageWeakRef(tensor.untyped_storage())


def trace_model(config: object, *, sequence: int, micro_batch_size: int, dtype: str) -> list[PartTrace]:
    """The head's, each decoder layer's and the tail's `PartTrace`, in order, for one forward of
    `config`'s model (with its loss) on a micro-batch of fake token ids."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    mode = FakeTensorMode()
    with mode:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.train()
    _, layers, tail = decoder_parts(model)
    parameters = {_key(p) for p in model.parameters()} | {_key(b) for b in model.buffers()}
    head, body, end = PartTrace(kind="head"), [PartTrace() for _ in layers], PartTrace(kind="tail")
    current: list[PartTrace] = [head]
    inputs: dict[int, object] = {}

    def enter(index: int):  # type: ignore[no-untyped-def]
        def hook(module, args, kwargs):  # type: ignore[no-untyped-def]
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[index] = _key(hidden)
            current.append(body[index])

        return hook

    def leave(module, args, output):  # type: ignore[no-untyped-def]
        current.pop()

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
    handles.append(tail[0].register_forward_pre_hook(lambda m, a: current.append(end)))
    shared: dict[object, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key in parameters:
            return tensor
        part = current[-1]
        size = tensor.untyped_storage().nbytes()
        maker = next((p for p in (head, *body, end) if key in p._made), None)
        if maker is None or maker is part or part is end or (part in body and inputs.get(body.index(part)) == key):
            if key not in part._saved:
                part._saved.add(key)
                part.saved_bytes += size
                if part in body and inputs.get(body.index(part)) == key:
                    part.saved_input_bytes += size
        else:  # made by an earlier part for every layer (rotary cos/sin, masks): held once per stage
            shared[key] = size
        return tensor

    try:
        with (
            mode,
            _as_real_tensors(),
            _Recorder(parameters, current),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            ids = torch.zeros(micro_batch_size, sequence, dtype=torch.long)
            flops = FlopCounterMode(display=False, custom_mapping=_flop_formulas())
            with flops:
                model(input_ids=ids, labels=ids, use_cache=False)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        raise InputError(
            "model_type",
            f"{config.model_type}: its forward does not run on fake tensors ({' '.join(str(exc).split())[:200]})",
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    counts = flops.get_flop_counts()
    prefix = type(model).__name__
    inner_name = next(n for n, m in model.named_modules() if m is layers)
    for i, part in enumerate(body):
        ops = counts.get(f"{prefix}.{inner_name}.{i}", {})
        part.forward_flops = float(sum(ops.values()))
        part.weight_flops = float(sum(n for op, n in ops.items() if "attention" not in str(op)))
    tail_names = [f"{prefix}.{name}" for name, module in model.named_modules() if any(module is t for t in tail)]
    end.forward_flops = end.weight_flops = float(sum(sum(counts.get(n, {}).values()) for n in tail_names))
    head.shared_bytes = float(sum(shared.values()))
    return [head, *body, end]


__all__ = ["DTYPES", "PartTrace", "trace_model"]
