"""Any decoder-only transformers model, built from its config on the meta device (no memory, no weights)
and its parameters counted exactly: per decoder layer, embedding, final norm and LM head, and the
multi-token-prediction (MTP) modules a config declares but transformers does not build.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from basics.errors import InputError, shown

# what a config.json carries that is provenance or remote code, not architecture
_NOT_ARCHITECTURE = ("auto_map", "_name_or_path", "transformers_version", "architectures", "quantization_config")
# the sizes a decoder-only config gives (Llama's names, GPT-2's): each a count of at least 1 where given
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
)
# config keys that give the number of MTP modules (DeepSeek-V3's, MindFormers' and Megatron's names)
MTP_KEYS = ("num_nextn_predict_layers", "mtp_depth", "mtp_num_layers")


@dataclass(frozen=True)
class PartCount:
    """One part of a model: its parameters, and of them the routed experts' (each token uses
    experts_per_token of num_experts of those)."""

    name: str
    kind: str  # "head", "body:<signature>", "mtp", "tail"
    parameters: int
    routed_parameters: int = 0
    tensors: int = 0  # parameter tensors (Adam keeps a step count per tensor)

    def active(self, experts_per_token: int, num_experts: int) -> float:
        """Parameters one token passes through: the routed experts' in proportion to those chosen."""
        if not self.routed_parameters:
            return float(self.parameters)
        return self.parameters - self.routed_parameters * (1 - experts_per_token / num_experts)


@dataclass(frozen=True)
class ModelCount:
    """Every part's parameter count, in model order (head, decoder layers, MTP modules, tail)."""

    model_type: str
    parts: tuple[PartCount, ...]
    experts_per_token: int = 0
    num_experts: int = 0
    tied_embeddings: bool = False
    output_parameters: int = 0  # the LM head's weight (the token embedding's, where tied)

    def total(self, *, mtp: bool = True) -> int:
        """All parameters, each counted once (tied embeddings once; MTP modules' own parameters, their
        embedding and output head being the main model's)."""
        return sum(p.parameters for p in self.parts if mtp or p.kind != "mtp")

    def active(self, *, mtp: bool = True, embedding: bool = False) -> float:
        """Parameters one token passes through, the input embedding left out unless asked (DeepSeek's
        and most model cards' convention: a lookup, not a matmul); a tied embedding counts as the head."""
        total = 0.0
        for part in self.parts:
            if part.kind == "mtp" and not mtp:
                continue
            if part.kind == "head" and not embedding and not self.tied_embeddings:
                continue
            total += part.active(self.experts_per_token, self.num_experts) if self.num_experts else part.parameters
        return total


def check_sizes(fields: Mapping[str, object]) -> None:
    """InputError naming the field where a config's size (its own or its text config's) is not an integer >= 1:
    transformers builds a zero-wide layer, and torch fails deep inside on a negative one."""
    for where in (fields, fields.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key in SIZE_FIELDS:
            value = where.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(key, f"expected an integer >= 1, got {shown(value)}")


def text_config(config: object) -> object:
    """The language model's config: `config` itself, or the text config of a multimodal one."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def build_config(fields: Mapping[str, object], *, field: str = "model_type", where: str = "") -> object:
    """A transformers `PretrainedConfig` from a config.json's fields (a plain dict); InputError naming `field`
    (`where`: the file, for the message) where transformers cannot build it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing to download
    from transformers import AutoConfig

    at = f"{where}: " if where else ""
    # remote code and provenance: not what the architecture is built from
    data = {k: v for k, v in fields.items() if k not in _NOT_ARCHITECTURE}
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise InputError(field, f"{at}expected a string `model_type` (llama, deepseek_v3, gemma2, ...)")
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs with it
    except ImportError:
        StrictDataclassError = ValueError
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        detail = " ".join(str(exc).split())
        raise InputError(field, f"{at}transformers cannot build model_type {model_type!r}: {detail}") from None


def build_meta_model(config: object) -> nn.Module:
    """`config`'s causal language model on the meta device: shapes only, built in seconds at any size."""
    from transformers import AutoModelForCausalLM

    kind = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise InputError("model_type", f"{kind} has no causal language model in transformers: {exc}") from None
    except (AttributeError, TypeError, KeyError, AssertionError) as exc:  # a field it reads is missing or wrong
        text = text_config(config)
        pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
        outside = isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab
        if isinstance(exc, AssertionError) and outside:  # torch's embedding asserts its padding index
            raise InputError(
                "pad_token_id", f"expected a token of the vocabulary (vocab_size {vocab}), got {pad}"
            ) from None
        detail = " ".join(str(exc).split())
        raise InputError("model_type", f"transformers cannot build {kind}'s model from this config: {detail}") from None


def decoder_parts(model: nn.Module) -> tuple[tuple[nn.Module, ...], nn.ModuleList, tuple[nn.Module, ...]]:
    """(the embeddings registered before the decoder layers: tokens', learned positions'; the decoder
    layers; the norms registered after them, and the LM head), whatever their names (Llama's `layers` and
    `norm`, GPT-2's `h` and `ln_f`). InputError naming model_type where another module holds parameters."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else None
    if inner is None or inner is model:  # Llama 4's text model names itself its decoder
        inner = getattr(model, "model", None)
    children = list(inner.children()) if isinstance(inner, nn.Module) else []
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):  # a decoder whose one list of blocks has another name
        lists = [m for m in children if isinstance(m, nn.ModuleList)]
        layers = lists[0] if len(lists) == 1 else None
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not any(m is layers for m in children):
        kind = getattr(model.config, "model_type", "?")
        raise InputError("model_type", f"{kind}: expected a decoder whose blocks are one list, e.g. `model.layers`")
    weighted = [(name, m) for name, m in inner.named_children() if next(m.parameters(), None) is not None]
    at = next(i for i, (_, m) in enumerate(weighted) if m is layers)  # rotary, dropout: no parameters, left out
    head, tail = [m for _, m in weighted[:at]], [m for _, m in weighted[at + 1 :]]
    # registration order is not run order: a projection or a per-layer embedding registered beside them runs
    # elsewhere (OPT's final norm before its layers, Gemma-3n's per-layer embeddings after)
    misplaced = [name for name, m in weighted[:at] if not isinstance(m, nn.Embedding)]
    misplaced += [name for name, m in weighted[at + 1 :] if "norm" not in type(m).__name__.lower()]
    if misplaced:
        kind = getattr(model.config, "model_type", "?")
        raise InputError(
            "model_type",
            f"{kind}: the parameters of {', '.join(misplaced)} lie outside the embeddings before the decoder "
            "layers and the norms after them; expected a decoder-only model",
        )
    tail.append(model.get_output_embeddings())
    return tuple(head), layers, tuple(m for m in tail if m is not None)


def _routed(module: nn.Module) -> int:
    """Parameters of the routed experts under `module`: those in a submodule named `experts`
    (transformers' stacked or listed experts), not the shared ones."""
    return sum(p.numel() for name, p in module.named_parameters() if "experts." in name and "shared" not in name)


def layer_signature(layer: nn.Module, layer_type: object = None) -> tuple:
    """What makes two decoder layers cost the same: their class, parameter shapes, attention type."""
    shapes = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
    return (type(layer).__name__, shapes, layer_type)


def signature_names(signatures: list[tuple]) -> list[str]:
    """A short kind name per distinct signature, in order of first appearance: "moe" where a layer has
    routed experts, else "dense", suffixed by the attention type where layers differ in it."""
    names: dict[tuple, str] = {}
    for signature in signatures:
        if signature in names:
            continue
        routed = any("experts." in name and "shared" not in name for name, _ in signature[1])
        base = "moe" if routed else "dense"
        if len({s[2] for s in signatures}) > 1 and signature[2] is not None:
            base += "-" + str(signature[2]).replace("_attention", "")
        name, n = base, 2
        while name in names.values():
            name, n = f"{base}{n}", n + 1
        names[signature] = name
    return [names[s] for s in signatures]


def mtp_depth(config: object) -> int:
    """How many MTP modules the config declares (0: none)."""
    for key in MTP_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def mtp_parameters(config: object, last_layer: nn.Module) -> int:
    """One MTP module's own parameters, as DeepSeek-V3 (and MindFormers, Megatron-LM) build it: a
    decoder layer like the model's last, RMSNorms of the embedding and of the hidden state, the
    projection of their concatenation (2h -> h) and the norm before the shared output head; the
    embedding and the head are the main model's."""
    hidden = int(config.hidden_size)
    layer = sum(p.numel() for p in last_layer.parameters())
    return layer + 3 * hidden + 2 * hidden * hidden


def count_parameters(config: object) -> ModelCount:
    """Every part's parameters, exact, from `config`'s model built on the meta device."""
    model = build_meta_model(config)
    head, layers, tail = decoder_parts(model)
    embedding = model.get_input_embeddings()
    tied = embedding is not None and any(p is embedding.weight for m in tail for p in m.parameters(recurse=False))
    layer_types = getattr(config, "layer_types", None) or [None] * len(layers)
    signatures = [layer_signature(layer, layer_types[i]) for i, layer in enumerate(layers)]
    kinds = signature_names(signatures)
    head_parameters = [p for m in head for p in m.parameters()]  # the embedding, and learned positions
    parts = [PartCount("head", "head", sum(p.numel() for p in head_parameters), 0, len(head_parameters))]
    parts += [
        PartCount(
            f"layers.{i}",
            f"body:{kinds[i]}",
            sum(p.numel() for p in layer.parameters()),
            _routed(layer),
            len(list(layer.parameters())),
        )
        for i, layer in enumerate(layers)
    ]
    for depth in range(mtp_depth(config)):  # its layer's tensors, two norms, the projection, the head's norm
        tensors = len(list(layers[-1].parameters())) + 4
        parts.append(PartCount(f"mtp.{depth}", "mtp", mtp_parameters(config, layers[-1]), _routed(layers[-1]), tensors))
    tail_parameters = {id(p): p.numel() for m in tail for p in m.parameters()}
    if tied:
        tail_parameters.pop(id(embedding.weight), None)
    parts.append(PartCount("tail", "tail", sum(tail_parameters.values()), 0, len(tail_parameters)))
    counted = sum(p.parameters for p in parts if p.kind != "mtp")
    whole = sum(p.numel() for p in model.parameters())
    if counted != whole:  # a parameter outside embedding, layers, final norm and head (a vision tower, ...)
        raise InputError(
            "model_type",
            f"{config.model_type}: {whole - counted:,} parameters lie outside the embedding, "
            "decoder layers, final norm and LM head; expected a decoder-only model",
        )
    text = text_config(config)
    experts = _first_int(text, ("n_routed_experts", "num_experts", "num_local_experts"))
    return ModelCount(
        model_type=str(config.model_type),
        parts=tuple(parts),
        experts_per_token=_first_int(text, ("num_experts_per_tok", "moe_topk")) if experts else 0,
        num_experts=experts,
        tied_embeddings=tied,
        output_parameters=model.get_output_embeddings().weight.numel(),
    )


def _first_int(config: object, keys: tuple[str, ...]) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
