"""Resumable checkpoints: written atomically (common/outputs.py) with the model in from_pretrained format beside
accelerate's state, read back with one-line errors for a folder that is no checkpoint, a truncated file or another
run's arguments; the whole weights of a sharded model for a save, and the final save of a policy (`save_policy`)."""

import copy
import glob
import json
import os
import pickle
import shutil

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load as load_states
from accelerate.utils import DistributedType, broadcast_object_list
from peft import set_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from common.core import UsageError, error_line
from common.models import VALUE_HEAD_FILE, peft_model_of
from common.outputs import RUN, atomic_directory, recover_directory, write_model_card


def save_checkpoint(
    accelerator: Accelerator, path: str, state: dict, model=None, tokenizer=None, total_limit: int | None = None
) -> None:
    """A resumable checkpoint, written atomically by the main process (every rank calls it): `model` and `tokenizer` in
    from_pretrained format if given, accelerate's state (optimizer, scheduler, RNG, the other prepared models) in
    accelerate_state/, and the loop's own `state` (its step, controllers), the run's id and arguments in
    trainer_state.json. `model`'s weights are stored once, in its from_pretrained files (under FSDP / DeepSpeed also in
    accelerate's sharded state). With `total_limit`, only the newest `total_limit` checkpoints of this run stay beside
    it (TRL's save_total_limit); other runs' are kept."""
    accelerator.wait_for_everyone()
    once = model is not None and stored_once(accelerator)
    weights = full_weights(accelerator, model) if model is not None else None  # a collective when sharded
    shards = None
    if not stored_once(accelerator):  # every rank writes its part of a sharded state, beside the checkpoint
        shards = [os.path.join(os.path.dirname(os.path.realpath(path)), f".tmp-state-{RUN['id']}")]
        shards = broadcast_object_list(shards)[0]  # the main process's name (each rank's run id has its own time)
        accelerator.save_state(shards)
        accelerator.wait_for_everyone()  # every rank's part written (its RNG state last) before the folder is moved
    if accelerator.is_main_process:
        with atomic_directory(path) as tmp:
            if model is not None:
                model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            skipped = []
            if shards:
                os.rename(shards, os.path.join(tmp, "accelerate_state"))
            else:

                def skip_model(models, weights, _):  # accelerate's hook: its copy of `model`'s weights is not written
                    for i, prepared in enumerate(models):
                        if accelerator.unwrap_model(prepared) is model:
                            weights.pop(i)
                            skipped.append(i)
                            return

                hook = accelerator.register_save_state_pre_hook(skip_model) if once else None
                try:
                    accelerator.save_state(os.path.join(tmp, "accelerate_state"))
                finally:
                    if hook is not None:
                        hook.remove()
            state = state | ({"model_in_folder": skipped[0]} if skipped else {})
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state | {"run": RUN["id"], "script": RUN["script"], "args": RUN["args"]}, f, default=str)
        parent = os.path.dirname(os.path.realpath(path))
        ours = []
        for folder in os.listdir(parent):
            try:
                with open(os.path.join(parent, folder, "trainer_state.json")) as f:
                    saved = json.load(f)
            except (OSError, ValueError):
                continue
            if saved.get("run") == RUN["id"]:
                ours.append((os.path.getmtime(os.path.join(parent, folder, "trainer_state.json")), folder))
        for _, folder in sorted(ours)[: -total_limit if total_limit else 0]:
            shutil.rmtree(os.path.join(parent, folder), ignore_errors=True)
    accelerator.wait_for_everyone()


def full_weights(accelerator: Accelerator, model) -> dict | None:
    """`model`'s whole state dict for its save_pretrained when it is sharded (FSDP, DeepSpeed ZeRO-3): every rank must
    call this, and the main process gets the gathered weights. None otherwise: save_pretrained reads its own."""
    if stored_once(accelerator):
        return None
    if accelerator.is_fsdp2:  # accelerate's get_state_dict also asks for broadcast_from_rank0: DTensors come back on CPU
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3:  # accelerate's needs a 16-bit gather
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = accelerator.unwrap_model(model).state_dict()
            return {k: v.detach().cpu().clone() for k, v in state.items()} if accelerator.is_main_process else None
    return accelerator.get_state_dict(model)


def stored_once(accelerator: Accelerator) -> bool:
    """Whether a checkpoint keeps its model's weights only in the from_pretrained files: not where accelerate saves
    sharded states (FSDP, DeepSpeed, Megatron), whose restore needs its own files."""
    return accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Load into `model` (plain, peft, or with a value head) the weights its save_pretrained wrote to `folder`."""
    if hasattr(model, "v_head"):
        model.v_head.load_state_dict(load_file(os.path.join(folder, VALUE_HEAD_FILE)))
    if hasattr(model, "critic"):  # ppo.py's separate value model, saved in critic/ beside the policy
        load_weights(model.critic, os.path.join(folder, "critic"))
    peft = peft_model_of(model)
    if peft is not None:
        set_peft_model_state_dict(peft, load_file(os.path.join(folder, "adapter_model.safetensors")))
        return
    inner = getattr(model, "pretrained_model", model)
    weights = {}
    for file in sorted(glob.glob(os.path.join(folder, "model*.safetensors"))):
        weights |= load_file(file)
    missing = inner.load_state_dict(weights, strict=False).missing_keys
    state = inner.state_dict()
    loaded = {state[name].data_ptr() for name in weights if name in state}
    untied = [name for name in missing if state[name].data_ptr() not in loaded]  # tied copies are loaded
    if untied:
        raise UsageError(f"--resume-from {folder}: its weights lack {', '.join(sorted(untied)[:3])}.")


def read_checkpoint(path: str) -> dict:
    """The loop's state in a checkpoint folder (trainer_state.json), once a save of it that was killed between its
    renames is finished or undone; a clear error when `path` is no checkpoint."""
    recover_directory(path)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise UsageError(
            f"--resume-from {path}: not a checkpoint folder (no trainer_state.json); pass one of the "
            "folders the --save-* flags write, e.g. {output_dir}_checkpoints/step_N."
        )
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        for file in glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True):
            with safe_open(file, "pt") as weights:  # reads the header and checks that the file holds all it lists
                weights.keys()
    except (ValueError, OSError, SafetensorError) as error:  # truncated or corrupt: name the file, no traceback
        raise UsageError(f"--resume-from {path}: a file of the checkpoint cannot be read ({error_line(error)}).") from None
    if not isinstance(state, dict):
        raise UsageError(f"--resume-from {path}: its trainer_state.json holds no state (a {type(state).__name__}).")
    return state


def load_checkpoint(accelerator: Accelerator, path: str) -> dict:
    """Restore accelerate's state from a folder `save_checkpoint` wrote (its random states must be readable: a resume
    that silently drew other random numbers would not continue the run); return the loop's state saved with it. The run
    continues as the checkpoint's, and a line says which arguments differ from the ones it was saved with."""
    state = read_checkpoint(path)
    folder = os.path.join(path, "accelerate_state")
    restored = []

    def take_model(models, _):  # the model whose weights save_checkpoint kept only in its from_pretrained files
        restored.append(models.pop(state["model_in_folder"]))

    rng = os.path.join(folder, f"random_states_{accelerator.process_index}.pkl")
    try:
        load_states(rng)  # accelerate's loader: weights_only, NumPy's generator state allowed
    except Exception as error:  # noqa: BLE001 - a missing, truncated or foreign file: one line, not a traceback
        raise UsageError(f"--resume-from {path}: its random state {rng} cannot be read ({type(error).__name__}).") from None
    hook = accelerator.register_load_state_pre_hook(take_model) if "model_in_folder" in state else None
    try:
        accelerator.load_state(folder)
        for model in restored:
            load_weights(accelerator.unwrap_model(model), path)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError, SafetensorError) as error:
        if isinstance(error, UsageError):
            raise
        # a truncated optimizer file, or a checkpoint of another model or optimizer: one line, not a traceback
        raise UsageError(
            f"--resume-from {path}: the checkpoint does not load into this run ({error_line(error)}); resume "
            "with the arguments it was saved with, from an intact checkpoint."
        ) from None
    finally:
        if hook is not None:
            hook.remove()
    RUN["id"] = state.get("run", RUN["id"])
    ignore = {"resume_from", "output_dir", "log_dir", "checkpoint_dir", "exp_name", "track", "save_freq", "save_steps"}
    changed = [
        f"--{k.replace('_', '-')} {v} -> {RUN['args'].get(k)}"
        for k, v in state.get("args", {}).items()
        if k not in ignore and str(v) != str(RUN["args"].get(k))
    ]
    if changed:
        accelerator.print(f"resuming with arguments that differ from the checkpoint's: {', '.join(changed)}")
    return state


def save_policy(
    args, accelerator: Accelerator, policy, tokenizer, metrics: dict, algorithm: str, path: str | None = None, final=True
) -> None:
    """The policy in plain from_pretrained format (LoRA merged; a value-head model's head beside it), with its tokenizer
    and model card, written atomically to `path` (default --output-dir); first a check that DDP kept every rank's
    weights the same. Every rank calls it. A save that is not `final` merges a copy: training goes on."""
    weights = full_weights(accelerator, policy)  # gathered on the main process when sharded (every rank calls it)
    if weights is None:  # replicated: every rank holds the same weights
        checksums = accelerator.gather(torch.stack([p.detach().float().sum() for p in policy.parameters()]).sum()[None])
        if not torch.allclose(checksums, checksums[0].expand_as(checksums)):
            raise RuntimeError(f"the ranks' weights differ (parameter sums {checksums.tolist()})")
    language_model = getattr(policy, "pretrained_model", policy)  # a value-head model's LM
    if peft_model_of(language_model) is not None:
        merged = (language_model if final else copy.deepcopy(language_model)).merge_and_unload()
        if language_model is not policy:  # the value head rides on the merged LM
            v_head, policy = policy.v_head, type(policy)(merged)
            policy.v_head = v_head
        else:
            policy = merged
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(path or args.output_dir) as tmp:
            policy.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, algorithm, metrics)
