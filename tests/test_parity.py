"""tests/parity.py, the refactoring guard: its comparison and its coverage of the scripts."""

import os

import torch
from conftest import ROOT
from parity import RUNS, differences


def test_differences_catch_one_ulp_and_missing_tensors():
    before = {"model.safetensors:w": torch.ones(3), "model.safetensors:b": torch.zeros(2)}
    nudged = dict(before, **{"model.safetensors:w": torch.nextafter(torch.ones(3), torch.tensor(2.0))})
    assert differences(before, {k: v.clone() for k, v in before.items()}) == []
    found = differences(before, nudged)
    assert len(found) == 1 and found[0].startswith("model.safetensors:w: max |difference| 1.19e-07")
    assert differences(before, {"model.safetensors:w": before["model.safetensors:w"]}) == ["only before: model.safetensors:b"]
    assert differences(before, dict(before, extra=torch.ones(1))) == ["only after: extra"]


def test_every_algorithm_script_has_a_parity_run():
    scripts = (
        {  # the runnable files at the top, but pipeline.py
            name[: -len(".py")]
            for name in os.listdir(ROOT)
            if name.endswith(".py") and '__name__ == "__main__"' in open(os.path.join(ROOT, name)).read()
        }
        - {"pipeline"}
    )
    assert {name.split("-")[0] for name in RUNS} == scripts and all(name.split("-")[0] in RUNS for name in RUNS)
