# train.py: every rank of `torchrun --nproc-per-node 2 train.py` runs this
import torch

import autoplan
from my_model import make_example

ex = make_example()
trainer = autoplan.compile(ex.model, "local", example_inputs=ex.example_inputs,
                           example_targets=ex.targets, loss_fn=ex.loss_fn,
                           optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                           global_batch_size=8, plan="my.plan.json")
torch.manual_seed(0)                                 # every rank passes the same global batch
tokens = torch.randint(0, 256, (8, 32))              # (your data loader here)
targets = torch.randint(0, 256, (8, 32))
for step in range(5):
    loss = trainer.step((tokens, targets))           # each rank takes its part of the batch
    if trainer.rank == 0:
        print(f"step {step} loss {loss:.4f}")
