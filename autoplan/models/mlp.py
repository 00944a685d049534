"""A plain multi-layer perceptron classifier: features -> hidden blocks -> class logits.

Layout (module paths the planner and the runtime address):

    layers.<i>.fc    nn.Linear   (in_features or hidden_size) -> hidden_size
    layers.<i>.act   nn.ReLU | nn.GELU
    head             nn.Linear   hidden_size -> num_classes

Every hidden block is the same small module, so ``layers.<i>`` names one block for pipeline
partitioning, and consecutive ``fc`` layers are the classic Megatron column/row pair for tensor
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_ACTIVATIONS = ("relu", "gelu")


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Shape of an :class:`MLP`. ``num_layers`` counts hidden blocks (the head is extra)."""

    in_features: int
    hidden_size: int
    num_layers: int
    num_classes: int
    activation: str = "relu"
    bias: bool = True

    def __post_init__(self) -> None:
        for field in ("in_features", "hidden_size", "num_layers", "num_classes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLPConfig.{field} must be a positive int, got {value!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"MLPConfig.activation must be one of {_ACTIVATIONS}, got {self.activation!r}"
            )

    def param_count(self) -> int:
        widths = [self.in_features] + [self.hidden_size] * self.num_layers + [self.num_classes]
        return sum(a * b + (b if self.bias else 0) for a, b in zip(widths, widths[1:]))


class MLPBlock(nn.Module):
    """One hidden block: Linear followed by the activation."""

    def __init__(self, in_features: int, out_features: int, *, activation: str, bias: bool):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features, bias=bias)
        self.act = nn.ReLU() if activation == "relu" else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """``forward(x: (batch, in_features) float) -> (batch, num_classes) logits``."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        widths = [config.in_features] + [config.hidden_size] * config.num_layers
        self.layers = nn.ModuleList(
            MLPBlock(widths[i], widths[i + 1], activation=config.activation, bias=config.bias)
            for i in range(config.num_layers)
        )
        self.head = nn.Linear(config.hidden_size, config.num_classes, bias=config.bias)

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default Linear initialisation, in module order. Call again after
        ``to_empty()`` to materialise a meta model."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# Named configurations (project examples, not published models).
MLP_CONFIGS: dict[str, MLPConfig] = {
    # Small enough to train in milliseconds; every width divides 2 and 4 for tensor parallelism.
    "mlp-tiny": MLPConfig(in_features=64, hidden_size=128, num_layers=3, num_classes=10),
    # A wider MLP whose matmuls dominate its cost (about 5.2M parameters).
    "mlp": MLPConfig(in_features=1024, hidden_size=1024, num_layers=4, num_classes=1000,
                     activation="gelu"),
}
