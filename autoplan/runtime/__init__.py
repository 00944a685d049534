"""The runtime: a plan applied to the model with PyTorch's parallel APIs, as a Trainer.

The only part of autoplan that starts process groups (``torch.distributed``).
"""
