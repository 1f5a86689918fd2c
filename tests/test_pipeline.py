import json
import os
import sys

import pytest
from conftest import ROOT, run_script

PIPELINE = os.path.join(ROOT, "pipeline.py")


@pytest.mark.slow
def test_pipeline_chains_the_stages_and_compares_on_unseen_prompts(tmp_path):
    # a `python` first on PATH that is not this interpreter (as when a venv's python is called without activating it):
    # the stages must still run under sys.executable
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'wrong interpreter' >&2\nexit 3\n")
    (fake / "python").chmod(0o755)
    out = run_script(
        [
            PIPELINE,
            "--output-dir",
            "pipe",
            "--heldout-prompts",
            "4",
            "--samples-per-prompt",
            "2",
            "--sft-args=--max-steps 3 --num-sample-generations 0 --eval-fraction 0.01",
            "--rm-args=--max-steps 3 --eval-fraction 0.02",
            "--ppo-args=--total-episodes 16 --eval-samples 4",
            "--dpo-args=--max-steps 2 --eval-fraction 0.02 --no-generate-during-eval",  # the pipeline samples its own
            "--kto-args=--max-steps 2 --eval-fraction 0.02 --no-generate-during-eval",
        ],
        tmp_path,
        PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
    )
    assert f"==== sft: {sys.executable} " in out
    pipe = tmp_path / "pipe"
    results = json.loads((pipe / "results.json").read_text())
    assert list(results["policies"]) == ["sft", "ppo", "dpo", "kto"] and list(results["stage_seconds"]) == [
        "sft",
        "reward_model",
        "ppo",
        "dpo",
        "kto",
    ]
    # the SFT policy evaluated against itself: its KL to SFT is exactly zero; the trained ones moved
    assert abs(results["policies"]["sft"]["KL to SFT"]) < 1e-4
    assert all(0 < policy["distinct-2"] <= 1 for policy in results["policies"].values())
    assert all(abs(results["policies"][name]["KL to SFT"]) > 1e-4 for name in ("ppo", "dpo", "kto"))
    # PPO was trained against the reward model of the previous stage, starting from the SFT model
    assert "--reward-model pipe/reward_model" in out and "ppo.py --model-name pipe/sft" in out
    # the held-out prompts are no prompt of any training file
    trained = {
        json.loads(line)["prompt"]
        for name in ("sft", "preferences", "prompts")
        for line in (pipe / "data" / f"{name}.jsonl").read_text().splitlines()
    }
    heldout = results["heldout_prompts"]
    assert len(heldout) == 4 and len(trained) > 900 and not trained & set(heldout)
    assert "pipeline: " in out and "RM" in out and "VADER" in out
