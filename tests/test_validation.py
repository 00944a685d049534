"""The cost model's published prediction error (docs/validation.md) cannot silently get worse.

Deterministic: every prediction is autoplan's estimate of a published Megatron-LM run
(benchmarks/validate.py), compared with the published figure; no clock is read.
"""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The error today. Lower these when the model improves; a change that raises them must be
# justified (and the page regenerated): `python benchmarks/validate.py --markdown docs/validation.md`
MAPE_CEILING = 0.0587     # 5.7 % on 2026-11-27: the cross entropy priced as torch's fp32 passes
#                           over the logits (7.5 -> 7.0 %), overlap interference measured
#                           (Lee et al. 2025, 18.9 %; 7.0 -> 6.5 %), ZeRO-1's gather in the
#                           dtype the weights are held in (bf16 for Megatron-LM; 6.5 -> 7.7 %:
#                           it had offset the H100 rows' common bias on the 32B row), the
#                           tp-comm-overlap GEMMs in Transformer Engine's row chunks at
#                           cuBLAS's rate for their rows (OpenXLA's sm_90 table; 7.7 -> 6.2 %),
#                           every layer product at the rate of its shape (the whole table;
#                           6.2 -> 5.7 %); 5.81 % on 2026-11-28: a tied embedding and LM head
#                           held once on a rank (its state, optimizer step and gradient sync
#                           had been counted twice: every GPT row at pp 1 a little faster, the
#                           H100 rows' under-prediction a little larger); 5.820 % on
#                           2026-11-28: a meta model traced as fake CPU tensors (the reshape
#                           after attention is a view, as on the CPU and CUDA, not a copy);
#                           5.863 % on 2026-11-28: FSDP's root unit held gathered through its
#                           forward and backward under ZeRO-3 (the weights outside the layers,
#                           not counted before): with the ZeRO-3 candidates' memory the
#                           search simulated other finalists, and the 177B @96 row found a
#                           faster plan (interleaved, per-op recompute: 104.4 -> 103.1 s
#                           predicted against 116.5 s published)
WORST_CEILING = 0.141     # 1.7B, -14.0 % (-13.4 % with its tied embedding counted twice; -21.9 %
#                           with its 128K-vocabulary loss priced as one bf16 read)
MEMORY_HEADROOM = 1.0       # every run's predicted peak fits its GPU


def _validate():
    spec = importlib.util.spec_from_file_location("validate", ROOT / "benchmarks" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["validate"] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results():
    v = _validate()
    graphs: dict = {}
    return v, [v.predict(r, graphs) for r in v.rows()]


def test_prediction_error_against_published_runs_is_pinned(results):
    v, res = results
    assert len(res) == 25
    assert v.mape(res) <= MAPE_CEILING
    assert max(abs(r.error) for r in res) <= WORST_CEILING


def test_every_published_run_fits_its_gpu_in_the_prediction(results):
    _, res = results
    for r in res:
        assert r.peak_memory_bytes <= MEMORY_HEADROOM * r.device_memory_bytes, r.row.label


def test_the_published_page_is_the_scripts_output(results, tmp_path):
    v, res = results
    page = tmp_path / "validation.md"
    v.write_page(str(page), res)
    assert page.read_text() == (ROOT / "docs" / "validation.md").read_text()
