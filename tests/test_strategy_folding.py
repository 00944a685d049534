"""Later layers take the first layer's strategies with their own value names (a 96-layer model
derives one layer's); they must be exactly what the rules derive for each op."""

import pytest

from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.sharding import strategies as S
from tests.conftest import has_transformers

MODELS = ["gpt-tiny", "llama-tiny", "nanogpt-tiny", "torch-encoder-tiny", "hf-t5-tiny",
          "hf-mixtral-tiny", "hf-gpt2-tiny"]


@pytest.mark.parametrize("name", MODELS)
def test_strategies_from_the_first_layer_equal_the_rules(name):
    if name.startswith("hf-") and not has_transformers():
        pytest.skip("transformers not installed")
    ex = build_example(name, device="meta", batch_size=2)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    later = S._first_layer_ops(g)
    assert later, "the model has repeated layers"
    for t in (2, 4):
        for op in g.ops:
            if not op.outputs:
                continue
            got = S.strategies(g, op, t)
            assert got == [S.replicate(op), *S._shaped(g, op, t)], (op.name, t)
        reused = [op for op in g.ops if op.name in later and op.outputs
                  and S._from_first_layer(g, op, t) is not None]
        assert len(reused) > 0.8 * len(later)            # nearly every later op is reused
