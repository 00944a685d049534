"""Named example models with inputs, targets and a loss: what the tests, the benchmarks, the CLI
and the runtime's serial-vs-parallel comparisons build on.

    ex = build_example("gpt-tiny", batch_size=4)
    loss = ex.loss_fn(ex.model(*ex.example_inputs), ex.targets)

Huge configurations are built on the meta device (``device="meta"``): parameters and inputs
are shape-only, nothing is allocated. On real devices the build is seeded, so two builds with
the same arguments have identical parameters and inputs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.gc_pause import with_fewer_collections
from autoplan.models.dlrm import DLRM, DLRM_CONFIGS, DLRMConfig
from autoplan.models.empty_weights import empty_weights
from autoplan.models.gpt import GPT, GPT_CONFIGS
from autoplan.models.hf import HF_CONFIGS, HFModelConfig, build_hf_model
from autoplan.models.llama import LLAMA_CONFIGS, Llama
from autoplan.models.mlp import MLP, MLP_CONFIGS, MLPConfig
from autoplan.models.resnet import RESNET_CONFIGS, ResNet, ResNetConfig
from autoplan.models.zoo import ZOO_CONFIGS, ZooConfig, build_zoo, inputs_kind
from autoplan.errors import AutoplanError, ConfigError
from autoplan.torchao_quiet import quiet_torchao_import

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Example:
    """A model ready to run: ``loss_fn(model(*example_inputs), targets)`` is a scalar loss."""

    name: str
    model: nn.Module
    example_inputs: tuple
    targets: torch.Tensor | None
    loss_fn: LossFn
    family: str
    config: Any

    def compute_loss(self) -> torch.Tensor:
        """One forward pass on the example inputs, reduced to the loss."""
        return self.loss_fn(self.model(*self.example_inputs), self.targets)

    @classmethod
    def from_model(cls, model: nn.Module, inputs: Any, targets: torch.Tensor,
                   loss_fn: LossFn, *, name: str | None = None) -> Example:
        """Your model as autoplan takes it: ``loss_fn(model(*inputs), targets)`` is the scalar
        loss of one example batch.

        ``inputs``: the tensor ``model`` takes, or a tuple or list of its positional arguments
        (tensors, meta tensors included). Their first dimension, and that of ``targets``, is
        the batch: autoplan plans and runs other batch sizes by splitting and repeating it.
        ``name`` (default: the model's class name) is what plans and reports call it. The
        rest of an Example (``family``, ``config``) describes autoplan's own example models
        and is filled in. A function of no arguments returning this is what ``autoplan plan``,
        ``run``, ``verify`` and ``emulate`` take as ``--model package.module:function``."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Example.from_model: model must be a torch.nn.Module, got "
                              f"{type(model).__name__}")
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            raise ConfigError(f"Example.from_model: inputs must be a tensor or a tuple of the "
                              f"model's positional arguments with at least one tensor, got "
                              f"{type(inputs).__name__} {inputs!r:.60}")
        if not isinstance(targets, torch.Tensor):
            raise ConfigError(f"Example.from_model: targets must be a tensor (what loss_fn "
                              f"compares the model's output with), got {type(targets).__name__}")
        if not callable(loss_fn):
            raise ConfigError(f"Example.from_model: loss_fn must be a function (output, targets) "
                              f"-> scalar loss, got {type(loss_fn).__name__}")
        rows = {tuple(t.shape[:1]) for t in (*tensors, targets)}
        if len(rows) != 1 or () in rows:
            shapes = ", ".join(str(tuple(t.shape)) for t in (*tensors, targets))
            raise ConfigError(f"Example.from_model: every input tensor and the targets need the "
                              f"same first (batch) dimension; got shapes {shapes} (inputs..., "
                              "targets)")
        if name is not None and not (isinstance(name, str) and name.strip()):
            raise ConfigError(f"Example.from_model: name must be a non-empty string, got "
                              f"{name!r}")
        return cls(name=name or type(model).__name__, model=model, example_inputs=args,
                   targets=targets, loss_fn=loss_fn, family="user", config=None)


# Losses are module-level functions so that examples pickle (process launchers need that).
def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position: logits (b, s, V), targets (b, s)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy: logits (b, classes), targets (b,) int64."""
    return F.cross_entropy(logits, targets)


def click_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross entropy on logits: logits (b,), targets (b,) float in {0, 1}."""
    return F.binary_cross_entropy_with_logits(logits, targets)


def hidden_state_loss(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error between an encoder's hidden states (b, s, h) and random targets of
    the same shape. (A target-free loss such as mean(hidden**2) is constant after the final
    LayerNorm and would give almost no gradient.)"""
    return F.mse_loss(hidden, targets)


class _Inputs:
    """Seeded random tensors on ``device``; shape-only (uninitialised) ones on meta."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)

    def randint(self, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty(shape, dtype=torch.int64, device="meta")
        return torch.randint(0, high, shape, generator=self.generator).to(self.device)

    def randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty(shape, dtype=torch.float32, device="meta")
        return torch.randn(shape, generator=self.generator).to(self.device)


def _token_inputs(config: Any, batch: int, seq_len: int, gen: _Inputs):
    # Targets are the inputs shifted by one position: a genuine next-token task.
    stream = gen.randint(config.vocab_size, (batch, seq_len + 1))
    return (stream[:, :-1].contiguous(),), stream[:, 1:].contiguous()


def _encoder_inputs(config: HFModelConfig, batch: int, seq_len: int, gen: _Inputs):
    tokens = gen.randint(config.vocab_size, (batch, seq_len))
    return (tokens,), gen.randn((batch, seq_len, config.hidden_size))


def _mlp_inputs(config: MLPConfig, batch: int, seq_len: int | None, gen: _Inputs):
    return (gen.randn((batch, config.in_features)),), gen.randint(config.num_classes, (batch,))


def _image_inputs(config: ResNetConfig, batch: int, seq_len: int | None, gen: _Inputs):
    shape = (batch, config.in_channels, config.image_size, config.image_size)
    return (gen.randn(shape),), gen.randint(config.num_classes, (batch,))


def _dlrm_inputs(config: DLRMConfig, batch: int, seq_len: int | None, gen: _Inputs):
    dense = gen.randn((batch, config.num_dense))
    sparse = gen.randint(config.rows_per_table, (batch, config.num_tables, config.bag_size))
    clicks = gen.randint(2, (batch,))
    return (dense, sparse), clicks.float()


def _zoo_inputs(config: ZooConfig, batch: int, seq_len: int | None, gen: _Inputs):
    kind = inputs_kind(config)
    if kind == "tokens":
        stream = gen.randint(config.vocab, (batch, seq_len + 1))
        return (stream[:, :-1].contiguous(),), stream[:, 1:].contiguous()
    if kind == "seq2seq":
        src = gen.randint(config.vocab, (batch, seq_len))
        tgt = gen.randint(config.vocab, (batch, seq_len + 1))
        return (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()
    if kind == "image":
        shape = (batch, config.channels, config.image_size, config.image_size)
        return (gen.randn(shape),), gen.randint(config.classes, (batch,))
    return (gen.randn((batch, seq_len, config.hidden)),), gen.randn((batch, seq_len,
                                                                     config.hidden))


_ZOO_LOSS = {"tokens": lm_loss, "seq2seq": lm_loss, "image": classification_loss,
             "features": hidden_state_loss}


@dataclass(frozen=True, kw_only=True)
class _Entry:
    family: str
    config: Any
    build: Callable[[Any], nn.Module]
    make_inputs: Callable[..., tuple[tuple, torch.Tensor | None]]
    loss_fn: LossFn
    # None: not a sequence model (seq_len must not be given). Otherwise the longest sequence
    # the config accepts, or 0 for no limit (rotary positions).
    max_seq_len: Callable[[Any], int | None]
    # built for the meta device under empty_weights() (the buffers its __init__ computes kept
    # on the CPU), not torch.device("meta"): models without an init_weights() that refills them
    meta_keeps_buffers: bool = False


def _no_seq(config: Any) -> None:
    return None


def _entries() -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for name, cfg in MLP_CONFIGS.items():
        entries[name] = _Entry(family="mlp", config=cfg, build=MLP, make_inputs=_mlp_inputs,
                               loss_fn=classification_loss, max_seq_len=_no_seq)
    for name, cfg in GPT_CONFIGS.items():
        entries[name] = _Entry(family="gpt", config=cfg, build=GPT, make_inputs=_token_inputs,
                               loss_fn=lm_loss, max_seq_len=lambda c: c.max_positions)
    for name, cfg in LLAMA_CONFIGS.items():
        entries[name] = _Entry(family="llama", config=cfg, build=Llama,
                               make_inputs=_token_inputs, loss_fn=lm_loss,
                               max_seq_len=lambda c: 0)
    for name, cfg in RESNET_CONFIGS.items():
        entries[name] = _Entry(family="cnn", config=cfg, build=ResNet, make_inputs=_image_inputs,
                               loss_fn=classification_loss, max_seq_len=_no_seq)
    for name, cfg in DLRM_CONFIGS.items():
        entries[name] = _Entry(family="dlrm", config=cfg, build=DLRM, make_inputs=_dlrm_inputs,
                               loss_fn=click_loss, max_seq_len=_no_seq)
    for name, cfg in HF_CONFIGS.items():
        is_bert = cfg.architecture == "bert"
        entries[name] = _Entry(family=f"hf-{cfg.architecture}", config=cfg, build=build_hf_model,
                               make_inputs=_encoder_inputs if is_bert else _token_inputs,
                               loss_fn=hidden_state_loss if is_bert else lm_loss,
                               max_seq_len=lambda c: c.max_positions)
    for name, cfg in ZOO_CONFIGS.items():
        kind = inputs_kind(cfg)
        entries[name] = _Entry(family=f"zoo-{cfg.architecture}", config=cfg, build=build_zoo,
                               make_inputs=_zoo_inputs, loss_fn=_ZOO_LOSS[kind],
                               max_seq_len=(_no_seq if kind == "image"
                                            else lambda c: c.max_positions),
                               meta_keeps_buffers=True)
    return entries


_REGISTRY: dict[str, _Entry] = _entries()


def list_examples() -> list[str]:
    """Names accepted by :func:`build_example`, grouped by family."""
    return list(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown example model {name!r}; known names: {', '.join(_REGISTRY)}"
        ) from None


def example_family(name: str) -> str:
    """The family of a named example ("mlp", "gpt", "llama", "cnn", "dlrm", "hf-...")."""
    return _entry(name).family


def get_config(name: str, **overrides: Any) -> Any:
    """The named config with ``overrides`` applied (lists become tuples), validated."""
    config = _entry(name).config
    if not overrides:
        return config
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown config field(s) {unknown} for example {name!r} "
            f"({type(config).__name__}); valid fields: {sorted(fields)}"
        )
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return dataclasses.replace(config, **values)


def layer_overrides(name: str, layers: int | None, strict: bool = True) -> dict[str, int]:
    """The override that sets example ``name``'s layer count to ``layers`` (its config calls
    it ``num_layers``, ``layers`` or ``n_layer``); empty for None. ``strict``: a config
    without a layer count raises ValueError instead of returning nothing."""
    if layers is None:
        return {}
    known = {f.name for f in dataclasses.fields(_entry(name).config)}
    field = next((f for f in ("num_layers", "layers", "n_layer") if f in known), None)
    if field is None and strict:
        raise ValueError(f"example {name!r} has no layer count to set; drop --layers")
    return {field: layers} if field is not None else {}


def _check_fits_in_host_memory(name: str, config: Any, device: torch.device) -> None:
    # Building a 10B-parameter table model on the CPU by mistake gets the process OOM-killed
    # with no message; refuse up front instead. Other devices raise their own OOM errors.
    if device.type != "cpu" or not hasattr(config, "param_count"):
        return
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        return
    param_bytes = 4 * config.param_count()
    if param_bytes > host_bytes // 2:
        raise ValueError(
            f"example {name!r} has {config.param_count():,} parameters "
            f"({param_bytes / 2**30:.1f} GiB in fp32), more than half of this host's "
            f"{host_bytes / 2**30:.1f} GiB of memory; build it with device='meta' or shrink it "
            "with overrides (e.g. num_layers=2)"
        )


@with_fewer_collections
def build_example(name: str, *, device: str | torch.device = "cpu", batch_size: int = 1,
                  seq_len: int | None = None, seed: int = 0, **overrides: Any) -> Example:
    """Build the named model with inputs, targets and loss.

    ``device="meta"`` builds shapes only (parameters and inputs on meta; the buffers a zoo
    model computes when built, such as torchtitan's rotary table, on the CPU). ``seq_len`` (sequence
    models only) defaults to the config's. ``overrides`` replace config fields, e.g.
    ``num_layers=2, attention="sdpa", dropout=0.0``. The model is returned in train mode.
    """
    entry = _entry(name)
    config = get_config(name, **overrides)
    device = torch.device(device)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    limit = entry.max_seq_len(config)
    if limit is None:
        if seq_len is not None:
            raise ValueError(
                f"seq_len applies to sequence models only; {name!r} is a {entry.family!r} model"
            )
    else:
        seq_len = config.seq_len if seq_len is None else seq_len
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if limit and seq_len > limit:
            raise ValueError(
                f"seq_len {seq_len} exceeds the {limit} learned positions of {name!r}; "
                f"also pass max_positions={seq_len} (or more) to lengthen the position table"
            )
    _check_fits_in_host_memory(name, config, device)

    if device.type != "meta":
        torch.manual_seed(seed)
    building = (empty_weights() if device.type == "meta" and entry.meta_keeps_buffers
                else torch.device(device))
    with building, quiet_torchao_import():     # (transformers imports torchao)
        model = entry.build(config)
    if device.type != "meta" and hasattr(model, "init_weights"):
        # Re-draw from a fresh seed so that materialize() of a meta build gives these exact
        # parameters (construction itself consumes the RNG for the default initialisers).
        torch.manual_seed(seed)
        model.init_weights()
    model.train()
    inputs, targets = entry.make_inputs(config, batch_size, seq_len, _Inputs(device, seed + 1))
    return Example(name=name, model=model, example_inputs=inputs, targets=targets,
                   loss_fn=entry.loss_fn, family=entry.family, config=config)


def example_param_count(name: str, **overrides: Any) -> int:
    """Number of distinct parameters (a tied weight counts once): from the config's formula
    where it has one, otherwise from a meta-device build."""
    config = get_config(name, **overrides)
    if hasattr(config, "param_count"):
        return int(config.param_count())
    with torch.device("meta"):
        model = _entry(name).build(config)
    return sum(p.numel() for p in model.parameters())


def materialize(model: nn.Module, *, device: str | torch.device = "cpu",
                seed: int = 0) -> nn.Module:
    """Give a meta-device example model real storage on ``device`` and initialise it exactly as
    ``build_example(..., device=device, seed=seed)`` would (same parameters, same buffers).
    Works for the native example models (those with ``init_weights``), not the Hugging Face
    ones. Returns the model (materialised in place)."""
    if not hasattr(model, "init_weights"):
        raise ValueError(
            f"{type(model).__name__} has no init_weights(); materialize() supports the native "
            "example models (mlp, gpt, llama, cnn, dlrm). Build Hugging Face examples directly "
            "on the target device instead"
        )
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def load_user_example(spec: str) -> Example:
    """The Example a ``package.module:function`` spec names, built by calling the function.
    The current folder is importable, as under ``python -m``. A spec that names no module, no
    function, or a function that needs arguments or returns no Example is an AutoplanError."""
    import importlib
    import inspect
    import sys

    mod_name, _, fn_name = spec.partition(":")
    usage = "give 'package.module:function', e.g. 'mymodels:make_example'"
    if not (all(p.isidentifier() for p in mod_name.split(".")) and fn_name.isidentifier()):
        raise AutoplanError(f"{spec!r} is not a model spec: {usage} (an absolute module path "
                            "and a function name)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise AutoplanError(f"cannot load {spec!r}: {e}; give 'package.module:function' "
                            "importable from the current environment") from e
    try:
        inspect.signature(fn).bind()
    except TypeError:            # not callable, or it needs arguments
        raise AutoplanError(f"{spec!r} is {type(fn).__name__} {fn!r:.50}, not a function of no "
                            "arguments returning an autoplan.models.Example; " + usage) from None
    except ValueError:           # a builtin without a signature: calling it tells
        pass
    example = fn()
    if not isinstance(example, Example):
        raise AutoplanError(f"{spec}() returned {type(example).__name__}, not an "
                            "autoplan.models.Example; return autoplan.Example.from_model(model, "
                            "inputs, targets, loss_fn)")
    return example
