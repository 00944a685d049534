"""ResNet-style convolutional classifier (He et al. 2016, "Deep Residual Learning for Image
Recognition"), with BasicBlock or Bottleneck residual blocks and BatchNorm.

Layout (module paths the planner and the runtime address):

    stem.conv / stem.bn / stem.relu / stem.pool   7x7/2 conv + 3x3/2 max pool ("imagenet"),
                                                  or 3x3/1 conv and no pool ("cifar")
    layers.<i>                                    every residual block of every stage, in order
      .conv1 .bn1 .conv2 .bn2 [.conv3 .bn3]       (Bottleneck has three convolutions)
      .downsample.0 / .downsample.1               1x1 strided conv + BatchNorm, when the shape
                                                  changes (He et al.'s projection shortcut)
    pool                                          nn.AdaptiveAvgPool2d(1)
    fc                                            nn.Linear  channels -> num_classes

All blocks sit in one flat ``nn.ModuleList`` so ``layers.<i>`` addresses one block whatever
stage it belongs to (a pipeline cut can fall inside a stage). The first block of stages 2-4
downsamples with stride 2 on its 3x3 convolution (the common "v1.5" placement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_BLOCKS = ("basic", "bottleneck")
_STEMS = ("imagenet", "cifar")


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """Shape of a :class:`ResNet`. ``widths`` are the per-stage base widths (the block output is
    ``width * 4`` for bottleneck blocks)."""

    block: str
    stage_depths: tuple[int, ...]
    widths: tuple[int, ...]
    num_classes: int
    image_size: int
    in_channels: int = 3
    stem: str = "imagenet"
    stem_width: int | None = None  # None -> widths[0]

    def __post_init__(self) -> None:
        if self.block not in _BLOCKS:
            raise ValueError(f"ResNetConfig.block must be one of {_BLOCKS}, got {self.block!r}")
        if self.stem not in _STEMS:
            raise ValueError(f"ResNetConfig.stem must be one of {_STEMS}, got {self.stem!r}")
        if len(self.stage_depths) != len(self.widths) or not self.stage_depths:
            raise ValueError(
                "ResNetConfig.stage_depths and widths must be non-empty and of equal length, "
                f"got {self.stage_depths!r} and {self.widths!r}"
            )
        for name, values in (("stage_depths", self.stage_depths), ("widths", self.widths)):
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"ResNetConfig.{name} must hold positive ints, got {values!r}")
        for field in ("num_classes", "image_size", "in_channels"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ResNetConfig.{field} must be a positive int, got {value!r}")

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)


def _downsample(in_ch: int, out_ch: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(_conv(in_ch, out_ch, 1, stride), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (He et al. 2016, Fig. 5 left)."""

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width
        self.conv1 = _conv(in_ch, width, 3, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, out_ch, 3)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + shortcut)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand by 4 (He et al. 2016, Fig. 5 right)."""

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width * 4
        self.conv1 = _conv(in_ch, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, out_ch, 1)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + shortcut)


class Stem(nn.Module):
    def __init__(self, config: ResNetConfig, out_ch: int):
        super().__init__()
        if config.stem == "imagenet":
            self.conv = _conv(config.in_channels, out_ch, 7, stride=2)
            self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.conv = _conv(config.in_channels, out_ch, 3)
            self.pool = nn.Identity()
        self.bn = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.bn(self.conv(x))))


class ResNet(nn.Module):
    """``forward(images: (b, in_channels, H, W) float) -> (b, num_classes) logits``."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        block_cls = Bottleneck if config.block == "bottleneck" else BasicBlock
        channels = config.stem_width or config.widths[0]
        self.stem = Stem(config, channels)
        blocks: list[nn.Module] = []
        for stage, (depth, width) in enumerate(zip(config.stage_depths, config.widths)):
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block_cls(channels, width, stride))
                channels = width * config.expansion
        self.layers = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, config.num_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """He-normal convolutions (fan-out), BatchNorm to identity, default Linear init. The
        residual branches' last BatchNorm is not zeroed, so every weight gets a gradient on the
        first step (parallel-vs-serial comparisons then check all of them)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
                module.reset_running_stats()
            elif isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for layer in self.layers:
            x = layer(x)
        return self.fc(torch.flatten(self.pool(x), 1))


# Named configurations. ResNet-18/50: He et al. 2016, Table 1 (11.7M / 25.6M parameters).
RESNET_CONFIGS: dict[str, ResNetConfig] = {
    # Project test model: CIFAR-sized input, narrow BasicBlock stages, trains in milliseconds.
    "resnet-tiny": ResNetConfig(block="basic", stage_depths=(1, 1, 1), widths=(8, 16, 32),
                                num_classes=10, image_size=32, stem="cifar"),
    # He et al. 2016, Table 1 "18-layer".
    "resnet18": ResNetConfig(block="basic", stage_depths=(2, 2, 2, 2), widths=(64, 128, 256, 512),
                             num_classes=1000, image_size=224),
    # He et al. 2016, Table 1 "50-layer".
    "resnet50": ResNetConfig(block="bottleneck", stage_depths=(3, 4, 6, 3),
                             widths=(64, 128, 256, 512), num_classes=1000, image_size=224),
}
