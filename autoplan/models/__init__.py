"""Example models the planner traces and the runtime trains, and a registry that builds them
by name with inputs, targets and a loss (see :func:`build_example`)."""

from autoplan.models.dlrm import DLRM, DLRMConfig
from autoplan.models.gpt import GPT, GPTConfig
from autoplan.models.hf import HFModelConfig, HFWrapper, build_hf_model
from autoplan.models.llama import Llama, LlamaConfig
from autoplan.models.mlp import MLP, MLPConfig
from autoplan.models.registry import (
    Example,
    build_example,
    example_family,
    example_param_count,
    get_config,
    list_examples,
    load_user_example,
    materialize,
)
from autoplan.models.resnet import ResNet, ResNetConfig

__all__ = [
    "DLRM",
    "DLRMConfig",
    "Example",
    "GPT",
    "GPTConfig",
    "HFModelConfig",
    "HFWrapper",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "build_example",
    "build_hf_model",
    "example_family",
    "example_param_count",
    "get_config",
    "list_examples",
    "load_user_example",
    "materialize",
]
