"""A vLLM server for the online scripts' rollouts (`--vllm-mode server`), on devices or machines of its own: vLLM's own
OpenAI-compatible server, started with what a trainer needs (TRL 1.16's `trl vllm-serve` then `vllm_mode="server"`):

    python -m common.vllm_server --model-name builtin:tiny-arith --port 8000
    python grpo.py --model-name builtin:tiny-arith --use-vllm --vllm-mode server --vllm-server-port 8000

Every training process sends its prompts to the server; after each weight sync the main process pushes the policy's
weights through vLLM's weight-transfer API (/init_weight_transfer_engine once, then /start_weight_update,
/update_weights, /finish_weight_update). The transport is a gloo group between the trainer's main process and the
server's workers (`GlooWeightTransferEngine`, registered with vLLM's factory in each worker): it runs on CPUs as on
GPUs, the tensors passing through host memory. vLLM's own NCCL backend (GPU to GPU, TRL's path) is not wired in.

The server starts from the model's own weights; the trainer's first sync replaces them with the policy's (LoRA merged,
or a resumed checkpoint's), so the server samples what the trainer trains.
"""

import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
import tyro

BACKEND = "gloo"  # the name the weight-transfer engine below is registered under, in --weight-transfer-config


@dataclass
class _GlooInit:
    """Where the trainer's main process listens (a TCPStore) and the group's size: the server's workers and the trainer
    (rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class _GlooUpdate:
    """The tensors one /update_weights call receives, in the order the trainer broadcasts them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _engine_class():
    """vLLM's weight-transfer engine over gloo (defined on first use: vLLM is imported only in the server's workers)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from common.vllm_engine import open_group

    class GlooWeightTransferEngine(WeightTransferEngine):
        """A server worker's side: each /update_weights receives its tensors by broadcast from the trainer and loads
        them through vLLM's layerwise reload (opened by /start_weight_update, closed by /finish_weight_update), which
        vLLM's CPU backend needs too (it repacks every linear weight for oneDNN once loaded)."""

        init_info_cls, update_info_cls = _GlooInit, _GlooUpdate
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: _GlooInit) -> None:
            config = self.parallel_config
            worker = config.data_parallel_index * config.world_size + config.rank  # unique over TP, PP and DP
            rank = worker + init_info.rank_offset
            self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # synchronous: no device to wait for

        def receive_weights(self, update_info: _GlooUpdate) -> None:
            if getattr(self, "group", None) is None:
                raise RuntimeError("the gloo weight transfer is not initialised: POST /init_weight_transfer_engine first")
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                try:
                    self.group.broadcast(tensor, 0).wait()
                except RuntimeError as error:  # the trainer's end of the group closed: it stopped mid-push
                    self.group = None  # the next trainer opens its own (/init_weight_transfer_engine)
                    logging.getLogger("vllm").warning(
                        "a trainer stopped in the middle of pushing its weights (%s); the update stays open until "
                        "the next trainer closes it and pushes all of them",
                        str(error).split("] ", 1)[-1].split(". ", 1)[0],
                    )
                    return  # (raised, vLLM would log its traceback in every process it passes through)
                self.model.load_weights([(name, tensor.to(self.device))])

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


class _WeightSync:
    """The server workers' extension (--worker-extension-cls): importing this module in a worker registers the gloo
    engine with vLLM's factory, before the worker loads its model and builds its weight-transfer engine. Its method
    joins the worker's own, callable through /collective_rpc."""

    def close_open_weight_update(self) -> bool:
        """Close the weight update a trainer left open (stopped between /start_weight_update and /finish_weight_update:
        killed, or its connection cut), which vLLM would hold against every later trainer's push; the layers it had not
        reloaded keep their weights, and a new trainer's first push replaces all of them. Whether one was open."""
        if not getattr(self, "_weight_update_active", False):
            return False
        self.finish_weight_update()
        return True


def _register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # the trainer's side without vLLM: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


if os.environ.get("RLHF_VLLM_SERVER_WORKER"):  # set by `main` for the server's processes only
    _register()


@dataclass
class ServeArgs:
    """Start vLLM's OpenAI-compatible server for `--vllm-mode server`; vLLM's own flags go after -- (e.g. -- --max-num-seqs
    64)."""

    model_name: str = "builtin:smollm2-135m-instruct"
    """the policy's model: a pretrained built-in (builtin:tiny-arith, builtin:smollm2-135m-instruct), a folder or a
    hub id; the trainer's --model-name"""
    host: str = "0.0.0.0"
    """the address to listen on (the trainer's --vllm-server-host)"""
    port: int = 8000
    """the port to listen on (the trainer's --vllm-server-port)"""
    dtype: str = "auto"
    """weights and compute: auto (the model's), float32, bfloat16, float16"""
    max_model_len: int | None = None
    """the longest prompt plus completion the server takes (default: the model's longest)"""
    tensor_parallel_size: int = 1
    """GPUs one copy of the model spans"""
    data_parallel_size: int = 1
    """copies of the model the server runs"""
    gpu_memory_utilization: float = 0.9
    """the share of each GPU's memory vLLM may take (the whole GPU is the server's)"""
    kv_cache_gib: int = 4
    """on CPU, GiB of memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)"""
    seed: int = 0
    """the server's seed (each request brings its own sampling seed)"""
    vllm_args: tyro.conf.Suppress[list[str]] = field(default_factory=list)  # vLLM's own flags, those after --


def serve_command(args: ServeArgs) -> list[str]:
    """vLLM's server flags for `args`: the RL endpoints' weight transfer over gloo, its engine registered by the worker
    extension, log-probs after the temperature (as the trainer's log_softmax(logits / T), TRL's setting)."""
    from common.loading import resolve

    folder = resolve(args.model_name)  # a pretrained built-in's cached folder (built on first use)
    command = ["--model", folder, "--served-model-name", args.model_name, "--host", args.host, "--port", str(args.port)]
    command += ["--dtype", args.dtype, "--seed", str(args.seed)]
    command += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    command += ["--data-parallel-size", str(args.data_parallel_size)]
    command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    command += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    command += ["--worker-extension-cls", "common.vllm_server._WeightSync", "--logprobs-mode", "processed_logprobs"]
    if not torch.cuda.is_available():
        command += ["--enforce-eager"]
    return command + args.vllm_args


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # vLLM's own flags come after --
    args = tyro.cli(ServeArgs, args=argv[:cut])
    args.vllm_args = argv[cut + 1 :]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # vLLM's server runs in this process, its engine and workers in processes it spawns, which inherit these: the RL
    # endpoints, our weight-transfer engine (registered by each worker that imports this package), vLLM's own logging
    os.environ.update(VLLM_SERVER_DEV_MODE="1", RLHF_VLLM_SERVER_WORKER="1")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    quiet = [  # in the processes vLLM starts: its use of torch.distributed.reduce_op; at a stop, what its killed
        "ignore::FutureWarning:vllm.triton_utils.dispatcher",  # processes left for the resource tracker to clean up
        "ignore::UserWarning:multiprocessing.resource_tracker",
    ]
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *quiet]))
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    check_address(args.host, args.port)
    check_servable(args.model_name)  # imports vLLM (quietly) where the model could be served: once, for both
    os.environ["VLLM_LOGGING_LEVEL"] = level  # the server logs as vLLM's own does, it and the processes it starts
    logging.getLogger("vllm").setLevel(level.upper())
    command = serve_command(args)
    print(f"serving {args.model_name} at http://{args.host}:{args.port} (vLLM's server, weight transfer over gloo)")
    sys.stdout.flush()
    from vllm.entrypoints.launchers.api_server.entry import main as serve  # `vllm serve`'s server, as a function

    sys.argv = ["vllm", *command]
    warnings.filterwarnings("ignore", message="Setuptools is replacing distutils")  # at /server_info's first answer
    stopping = _Stopping()
    for name in ("vllm.entrypoints.launchers.launcher", "vllm.v1.engine.core_client", "vllm.v1.engine.async_llm"):
        logging.getLogger(name).addFilter(stopping)
    serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM has shut down: no interpreter teardown, where triton's bindings list ~40 "leaked" objects


class _Stopping(logging.Filter):
    """At a stop the server was asked for (Ctrl-C, SIGTERM), vLLM kills its engine first, and the output handler then
    logs the dead engine's traceback: dropped once vLLM has logged that its shutdown began (its "[shutdown]" lines)."""

    began = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.began = self.began or record.getMessage().startswith("[shutdown]")
        dead = record.exc_info is not None and record.exc_info[0] is not None
        return not (self.began and dead and record.exc_info[0].__name__ == "EngineDeadError")


def check_address(host: str, port: int) -> None:
    """One line, before vLLM is imported, when the server could not listen at host:port: a port another process holds
    (an earlier server still running), or an address of no interface of this machine."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's own socket: a stopped server's port
            probe.bind(address)  # is free at once
    except OSError as error:
        fail(
            f"--host {host} --port {port}: the server cannot listen there ({error.strerror or error}); stop what holds "
            "the port (an earlier server?) or pick another --port"
        )


def check_servable(model_name: str) -> None:
    """One line, before vLLM starts: a random built-in (no folder to serve; checked first, before vLLM is imported),
    vLLM missing, or a model vLLM's CPU backend cannot run (its attention's head sizes)."""
    from common.core import UsageError
    from common.loading import is_random_builtin

    try:
        no_folder = is_random_builtin(model_name)
    except UsageError as error:  # an unknown built-in
        fail(str(error))
    if no_folder:
        fail(
            f"--model-name {model_name}: a random built-in has no folder to serve; serve a pretrained built-in "
            "(builtin:tiny-arith, builtin:smollm2-135m-instruct) or a folder"
        )
    if torch.cuda.is_available():
        return
    from common.vllm_engine import check_cpu_attention, check_vllm

    try:
        check_vllm()
        check_cpu_attention(model_name, "--model-name")
    except UsageError as error:
        fail(str(error))


def fail(message: str) -> None:
    """A mistake in the serve command: one line, exit status 2 (the scripts' convention), before vLLM starts."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


if __name__ == "__main__":
    main()
