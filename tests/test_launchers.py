"""Scale through accelerate: the same global batch trains the same model under 1 process, DDP x2 and FSDP2 x2.

Every run here is real: 2 processes over gloo on CPU, FSDP2 with full sharding (configs/fsdp_cpu.yaml, what CI runs),
and DeepSpeed ZeRO-2 / ZeRO-3 engines with one process (accelerate starts DeepSpeed on CPU for one process only).

Tolerance. DDP and FSDP sum the ranks' gradients in another order than one process does, so float32 results differ by
rounding: per-step losses agree to 1e-5 relative. Weights agree to a quarter of the learning rate: Adam divides each
gradient by its own running scale, so a weight whose gradient is at the level of rounding noise can move by a fraction
of the learning rate in another direction (measured: at most 0.1 x lr over 4 sft steps, 1e-3 x lr for dpo). A loss
averaged per rank instead of over the global batch misses both bounds by orders of magnitude (sft: 1e-2 relative).
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ARITH, DDP_ENV, ROOT, ddp_launch, free_port, fsdp_launch, read_scalars, run_in_process, run_script
from safetensors.torch import load_file

from common.core import UsageError
from common.run import deepspeed_settings

SFT, DPO, PPO, GRPO, ILQL = (os.path.join(ROOT, f"{name}.py") for name in ("sft", "dpo", "ppo", "grpo", "ilql"))
LAUNCHERS = {"ddp": ddp_launch, "fsdp": fsdp_launch}


@pytest.fixture(scope="module")
def no_dropout(tmp_path_factory) -> str:
    """benchmarks/launchers.py's tiny GPT-2 without dropout, in a local folder."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from launchers import no_dropout_model

    return no_dropout_model(str(tmp_path_factory.mktemp("no-dropout")))


def deepspeed_launch(cwd, stage: int, steps: int) -> list[str]:
    """`accelerate launch` of one process under a DeepSpeed ZeRO-`stage` config (as configs/deepspeed_zero*.yaml, in
    float32), with zero.Init asked for at stage 3 as configs/deepspeed_zero3.yaml does."""
    config = os.path.join(cwd, f"zero{stage}.yaml")
    with open(config, "w") as f:
        f.write(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: {steps}\n  zero_stage: ")
        f.write(f"{stage}\n  zero3_init_flag: {str(stage == 3).lower()}\nnum_processes: 1\nmixed_precision: 'no'\n")
    return ["-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", free_port()]


def launch(name: str, command: list[str], cwd, steps: int = 1) -> str:
    """`command` under 1 process (in-process), `accelerate launch` of 2 processes with DDP or FSDP2, or of one process
    under DeepSpeed ZeRO-2 / ZeRO-3 (`steps`: the config's gradient accumulation), each on one thread."""
    out_flags = ["--output-dir", name, "--log-dir", f"{name}_runs"]
    if name == "one":
        return run_script([*command, *out_flags], cwd)
    if name.startswith("zero"):
        prefix = deepspeed_launch(cwd, int(name[-1]), steps)
        return run_script([*prefix, *command, *out_flags], cwd, timeout=300, OMP_NUM_THREADS="1")
    return run_script([*LAUNCHERS[name](), *command, *out_flags], cwd, timeout=300, **DDP_ENV)


def weights(cwd, name: str, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(os.path.join(cwd, name, file))


def assert_equal_runs(cwd, names: list[str], tag: str, lr: float, files=("model.safetensors",)) -> None:
    """Per-step `tag` within 1e-5 relative, the saved weights within lr / 4 (the module docstring says why)."""
    first = names[0]
    for name in names[1:]:
        ours, theirs = (read_scalars(os.path.join(cwd, f"{n}_runs"), tag) for n in (first, name))
        assert len(ours) == len(theirs) > 1 and ours == pytest.approx(theirs, rel=1e-5), (name, tag, ours, theirs)
        for file in files:
            a, b = weights(cwd, first, file), weights(cwd, name, file)
            assert a.keys() == b.keys()
            gap = max((a[k] - b[k]).abs().max().item() for k in a)
            assert gap <= lr / 4, (name, file, gap)


@pytest.mark.slow
def test_sft_is_the_same_under_one_process_ddp_and_fsdp_and_resumes_under_fsdp(tmp_path, no_dropout):
    """Global batch 8: 1 x 8 == DDP 2 x 4 == FSDP2 2 x 4 (the loss is the mean over the global batch's tokens, pooled
    over the ranks), with the same warmup schedule; an FSDP2 checkpoint (every rank's part of the sharded state)
    resumes to the uninterrupted run's weights bit for bit, and the saved model loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    flags = [SFT, "--model-name", no_dropout, "--max-steps", "4", "--max-seq-length", "32", "--eval-steps", "100"]
    flags += ["--warmup-ratio", "0.5", "--lr-scheduler-type", "linear", "--num-sample-generations", "2"]
    launch("one", [*flags, "--batch-size", "8"], tmp_path)
    out = launch("ddp", [*flags, "--batch-size", "4"], tmp_path)
    assert out.count("sft: 4 steps") == 1 and "of 8 examples" in out  # printed once; 2 ranks x 4
    out = launch("fsdp", [*flags, "--batch-size", "4", "--save-steps", "2"], tmp_path)
    assert out.count("sft: 4 steps") == 1 and "of 8 examples" in out
    assert_equal_runs(tmp_path, ["one", "ddp", "fsdp"], "train/loss", lr=1e-3)
    one, two = (read_scalars(str(tmp_path / f"{n}_runs"), "train/learning_rate") for n in ("one", "ddp"))
    assert one == pytest.approx(two) and max(range(4), key=lambda i: one[i]) == 1  # the warmup's peak, after step 2
    # resume the FSDP run from its step-2 checkpoint: the same final weights, bit for bit
    checkpoint = tmp_path / "fsdp_checkpoints" / "step_2"
    assert [f for f in os.listdir(checkpoint / "accelerate_state") if "fsdp" in f]  # accelerate's sharded model state
    out = run_script([*fsdp_launch(), *flags, "--batch-size", "4", "--resume-from", str(checkpoint), "--output-dir",
                      "resumed", "--log-dir", "resumed_runs"], tmp_path, timeout=300, **DDP_ENV)  # fmt: skip
    assert "resumed from" in out
    straight, resumed = weights(tmp_path, "fsdp"), weights(tmp_path, "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp")  # plain transformers, no accelerate
    assert all(torch.equal(v, straight[k]) for k, v in model.state_dict().items() if k in straight)


@pytest.mark.slow
def test_dpo_is_the_same_under_one_process_ddp_and_fsdp(tmp_path, no_dropout, pairs_file):
    """The reference model sharded like the policy under FSDP2; eval samples decoded on every rank in step. 9 pairs of
    40 are held out: rank 0's 5 take two batches of 4, rank 1's 4 one, so rank 1 scores a stand-in batch at weight 0
    and both ranks reach the same collectives (under FSDP each forward is one: gloo aborted on a size mismatch)."""
    flags = [DPO, "--model-name", no_dropout, "--dataset-name", pairs_file, "--max-steps", "3", "--eval-steps", "100"]
    flags += ["--eval-fraction", "0.23"]
    launch("one", [*flags, "--batch-size", "8"], tmp_path)
    for name in ("ddp", "fsdp"):
        out = launch(name, [*flags, "--batch-size", "4"], tmp_path)
        assert out.count("dpo: 3 steps") == 1 and "31 training / 9 eval pairs" in out
    assert_equal_runs(tmp_path, ["one", "ddp", "fsdp"], "train/loss", lr=1e-4)


@pytest.mark.slow
def test_ilql_is_the_same_under_one_process_ddp_and_fsdp(tmp_path, no_dropout):
    """Every ilql term is a mean over the global batch's actions, pooled over the ranks (per-rank means differed from one
    process by up to 5e-2 relative); its new heads start as rank 0 drew them on every rank (FSDP2 sharded each rank's
    own draw: 7e-3 from the first step). One held-out prompt for two ranks: rank 1 answers it at weight 0, so both
    reach every collective (it used to wait forever in the gather)."""
    flags = [ILQL, "--model-name", no_dropout, "--max-steps", "3", "--max-length", "24", "--max-new-tokens", "4"]
    flags += ["--eval-samples", "1"]
    launch("one", [*flags, "--batch-size", "8"], tmp_path)
    for name in ("ddp", "fsdp"):
        out = launch(name, [*flags, "--batch-size", "4"], tmp_path)
        assert "1 eval prompts per process" in out and out.count("ilql: 3 steps") == 1
    files = ("model.safetensors", "ilql_heads.safetensors")
    for tag in ("losses/loss", "losses/loss_q", "losses/loss_awac", "values/advantage"):
        assert_equal_runs(tmp_path, ["one", "ddp", "fsdp"], tag, lr=1e-3, files=files)


@pytest.mark.slow
def test_grpo_and_ppo_are_the_same_under_ddp_and_fsdp(tmp_path):
    """Sampling draws from per-rank seeds, so 2 processes see other completions than 1 (docs/scaling.md): DDP x2 and
    FSDP2 x2 sample the same ones, and must then train the same model. grpo pools the reward statistics over the ranks
    (--scale-rewards batch) and checks that DDP's ranks end with identical weights; ppo shards its policy with the
    value head, the reference and the reward model."""
    grpo = [GRPO, *ARITH["grpo"], "--model-name", "builtin:tiny-gpt2", "--total-prompts", "8", "--num-generations", "4"]
    grpo += ["--batch-size", "2", "--mini-batch-size", "4", "--gradient-accumulation-steps", "2", "--eval-samples", "8"]
    grpo += ["--train-size", "64", "--eval-size", "8", "--scale-rewards", "batch", "--log-freq", "1"]
    (tmp_path / "grpo").mkdir()
    grpo_out = {name: launch(name, grpo, tmp_path / "grpo") for name in ("ddp", "fsdp")}
    assert "weights identical on 2 ranks" in grpo_out["ddp"] and "sharded over 2 ranks" in grpo_out["fsdp"]
    for tag in ("reward", "entropy", "grad_norm"):
        assert_equal_runs(tmp_path / "grpo", ["ddp", "fsdp"], tag, lr=1e-4)
    ppo = [PPO, "--model-name", "builtin:tiny-gpt2", "--batch-size", "4", "--mini-batch-size", "2"]
    ppo += ["--min-new-tokens", "8", "--max-new-tokens", "8", "--eval-samples", "8", "--total-episodes", "32"]
    (tmp_path / "ppo").mkdir()
    for name in ("ddp", "fsdp"):
        out = launch(name, ppo, tmp_path / "ppo")
        assert "ppo: 4 updates, 32 episodes" in out and out.count("policy builtin:tiny-gpt2") == 1
    files = ("model.safetensors", "value_head.safetensors")
    assert_equal_runs(tmp_path / "ppo", ["ddp", "fsdp"], "ppo/loss/total", lr=7e-5, files=files)


@pytest.mark.slow
def test_grpo_and_ppo_under_deepspeed_zero3_train_as_one_process(tmp_path):
    """DeepSpeed's engine steps at every backward that accelerate does not mark as accumulating, clips by its own config
    and, under ZeRO-3, holds each parameter as an empty placeholder outside a forward. Under ZeRO-3, grpo with 2
    mini-batches per optimizer step (DeepSpeed steps at the step's last: accumulate) and a reference placed before the
    policy is prepared, and ppo (no clipping, as --max-grad-norm's default; the value head; the reference and the
    reward model placed after; the whole model gathered for the save) train what one plain process trains."""
    grpo = [GRPO, *ARITH["grpo"], "--model-name", "builtin:tiny-gpt2", "--total-prompts", "8", "--num-generations", "4"]
    grpo += ["--batch-size", "4", "--mini-batch-size", "8", "--gradient-accumulation-steps", "2", "--eval-samples", "8"]
    grpo += ["--train-size", "64", "--eval-size", "8", "--log-freq", "1", "--beta", "0.04"]
    (tmp_path / "grpo").mkdir()
    for name in ("one", "zero3"):
        launch(name, grpo, tmp_path / "grpo", steps=2)
    for tag in ("reward", "entropy", "grad_norm", "kl"):
        assert_equal_runs(tmp_path / "grpo", ["one", "zero3"], tag, lr=1e-4)
    ppo = [PPO, "--model-name", "builtin:tiny-gpt2", "--batch-size", "8", "--mini-batch-size", "4"]
    ppo += ["--min-new-tokens", "8", "--max-new-tokens", "8", "--eval-samples", "8", "--total-episodes", "32"]
    (tmp_path / "ppo").mkdir()
    for name in ("one", "zero3"):
        launch(name, ppo, tmp_path / "ppo")
    files = ("model.safetensors", "value_head.safetensors")
    assert_equal_runs(tmp_path / "ppo", ["one", "zero3"], "ppo/loss/total", lr=7e-5, files=files)


def test_deepspeed_takes_the_scripts_clipping_and_accumulation():
    """The script's --max-grad-norm (None: off) and accumulation reach DeepSpeed's config where it says "auto"; a config
    that accumulates otherwise than the script is a one-line error, not a run with another batch."""
    plugin = SimpleNamespace(
        zero_stage=2, deepspeed_config={"gradient_clipping": "auto", "gradient_accumulation_steps": "auto"}
    )
    deepspeed_settings(plugin, SimpleNamespace(max_grad_norm=None, gradient_accumulation_steps=4, mini_batch_size=2))
    assert plugin.deepspeed_config == {
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 2,
    }
    plugin.deepspeed_config |= {"gradient_clipping": 0.5, "gradient_accumulation_steps": 1}
    with pytest.raises(UsageError, match="accumulates 1 steps and the script 4: set gradient_accumulation_steps: 4"):
        deepspeed_settings(plugin, SimpleNamespace(max_grad_norm=1.0, gradient_accumulation_steps=4))
    deepspeed_settings(plugin, SimpleNamespace(max_grad_norm=1.0, gradient_accumulation_steps=1, batch_size=8))
    assert plugin.deepspeed_config["gradient_clipping"] == 0.5  # the config's own value stands


def test_a_launch_whose_processes_would_train_alone_is_an_error(tmp_path):
    """Two processes that accelerate would run as two lone runs (no GPU, no ACCELERATE_USE_CPU=1) stop with one line."""
    _, error = run_in_process([SFT, "--model-name", "builtin:tiny-gpt2", "--max-steps", "1"], tmp_path, WORLD_SIZE="2")
    assert "2 processes were launched but each would train alone" in str(error) and "ACCELERATE_USE_CPU=1" in str(error)


@pytest.mark.slow
def test_ppo_with_a_separate_critic_is_the_same_under_ddp_fsdp_and_deepspeed_zero3(tmp_path):
    """ppo.py's separate critic is prepared with the policy as one module (one optimizer, a parameter group each): DDP x2
    and FSDP2 x2 train the same policy and critic (after a critic-only update), and one process under ZeRO-3 (the critic
    partitioned and gathered for the save) trains what a plain process trains; the critic lands in critic/ under every
    launcher. (Not the warm-up under DeepSpeed: its engine steps Adam over the policy's zero gradients, which the other
    launchers skip, so the policy's first steps after it differ by Adam's bias correction: docs/ppo.md.)"""
    ppo = [PPO, "--model-name", "builtin:tiny-gpt2", "--batch-size", "4", "--mini-batch-size", "2", "--eval-samples", "8"]
    ppo += ["--min-new-tokens", "8", "--max-new-tokens", "8", "--total-episodes", "16", "--n-samples-per-prompt", "2"]
    ppo += ["--value-model-path", "policy", "--critic-learning-rate", "1e-4"]
    files = ("model.safetensors", "critic/model.safetensors", "critic/value_head.safetensors")
    for pair, warmup in ((("ddp", "fsdp"), ["--freezing-actor-steps", "1"]), (("one", "zero3"), [])):
        (tmp_path / pair[0]).mkdir()
        for name in pair:
            assert "critic: a separate value model from policy" in launch(name, [*ppo, *warmup], tmp_path / pair[0])
        assert_equal_runs(tmp_path / pair[0], list(pair), "ppo/loss/total", lr=1e-4, files=files)


@pytest.mark.slow
def test_the_tests_launcher_ends_on_the_first_failing_rank(tmp_path):
    """tests/launching.py, which forks these tests' ranks, ends a launch as torchrun does: on the first rank that fails,
    with its exit status and its traceback in the output; a script's one-line error keeps its exit status 2 and its one
    line (the script's excepthook, as in a fresh process)."""
    from launching import run

    (tmp_path / "boom.py").write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 fails')\ndist.barrier()\n"
    )
    env = dict(os.environ, **DDP_ENV)
    status, _, stderr = run([*ddp_launch(), "boom.py"], tmp_path, env, timeout=120)
    assert status == 1 and "RuntimeError: rank 1 fails" in stderr, stderr[-2000:]
    status, _, stderr = run([*ddp_launch(), SFT, "--model-name", "builtin:tiny-gpt2", "--batch-size", "0"], tmp_path, env, 120)
    assert status == 2 and stderr.count("error: --batch-size 0") == 1 and "Traceback" not in stderr, stderr[-2000:]
