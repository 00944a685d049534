# my_model.py: a model of your own, as autoplan takes it (the module, one batch, the loss)
import torch
from torch import nn

import autoplan


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 128)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(
            128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True) for _ in range(4))
        self.head = nn.Linear(128, 256)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_example():
    tokens = torch.randint(0, 256, (4, 32))        # a batch: 4 sequences of 32 tokens
    targets = torch.randint(0, 256, (4, 32))
    return autoplan.Example.from_model(TinyLM(), tokens, targets, loss_fn)
