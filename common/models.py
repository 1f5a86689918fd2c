"""Value-head models, reference-model creation (TRL 0.8 `trl/models` semantics, shared layers fixed), reward models."""

import contextlib
import copy
import json
import os

import torch
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

from common.core import UsageError
from common.loading import is_random_builtin, load_config, load_pretrained, load_tokenizer

VALUE_HEAD_FILE = "value_head.safetensors"
REWARD_NORMALIZATION_FILE = "reward_normalization.json"


class ValueHead(nn.Module):
    """hidden state -> scalar. init "zero" (lm-human-preferences) or "normal" with std `init_std`."""

    def __init__(self, hidden_size: int, dropout: float = 0.0, init: str = "zero", init_std: float = 0.2):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.summary = nn.Linear(hidden_size, 1)
        if init == "zero":
            nn.init.zeros_(self.summary.weight)
        elif init == "normal":
            nn.init.normal_(self.summary.weight, std=init_std)
        else:
            raise ValueError(f"Unknown value head init {init!r}: choose zero or normal.")
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(hidden_states.to(self.summary.weight.dtype))
        return self.summary(hidden_states).squeeze(-1)


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM (plain or peft) plus a scalar value head on its last hidden state: forward(...) -> (logits [B, T, V],
    values [B, T]). `save_pretrained` writes the LM as usual (plain `AutoModelForCausalLM.from_pretrained` loads it)
    and the head in `value_head.safetensors` beside it."""

    auto_class = AutoModelForCausalLM

    def __init__(self, pretrained_model: nn.Module, **value_head_kwargs):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config
        hidden_size = self.config.get_text_config().hidden_size
        self.v_head = ValueHead(hidden_size, **value_head_kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str, value_head_kwargs: dict | None = None, **model_kwargs):
        """Load a hub id, local folder or built-in preset; a folder's value head and peft adapter load back."""
        adapter_config = os.path.join(name_or_path, "adapter_config.json")
        if os.path.isfile(adapter_config):
            with open(adapter_config) as f:
                base_name = json.load(f)["base_model_name_or_path"]
            base = load_pretrained(base_name, cls.auto_class, **model_kwargs)
            pretrained_model = PeftModel.from_pretrained(base, name_or_path, is_trainable=True)
        else:
            pretrained_model = load_pretrained(name_or_path, cls.auto_class, **model_kwargs)
        model = cls(pretrained_model, **(value_head_kwargs or {}))
        head_file = os.path.join(name_or_path, VALUE_HEAD_FILE)
        if os.path.isfile(head_file):
            model.v_head.load_state_dict(load_file(head_file))
        return model

    def _last_hidden_state(self, outputs) -> torch.Tensor:
        return outputs.hidden_states[-1]

    def forward(self, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = self.pretrained_model(**inputs, output_hidden_states=True, use_cache=False)
        return outputs.logits, self.v_head(self._last_hidden_state(outputs))

    def generate(self, *args, **kwargs):
        if hasattr(self, "unshard"):  # FSDP2 wraps this module: its own weights are gathered for decoding
            self.unshard()
        try:
            return self.pretrained_model.generate(*args, **kwargs)
        finally:
            if hasattr(self, "reshard"):
                self.reshard()

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        """`state_dict`: this module's whole state (gathered when sharded), split between the LM and the head."""
        parts = {"pretrained_model.": None, "v_head.": self.v_head.state_dict()}
        for prefix in parts if state_dict is not None else ():
            parts[prefix] = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        self.pretrained_model.save_pretrained(save_directory, state_dict=parts["pretrained_model."], **kwargs)
        head = {k: v.contiguous() for k, v in parts["v_head."].items()}
        save_file(head, os.path.join(save_directory, VALUE_HEAD_FILE))


class AutoModelForSeq2SeqLMWithValueHead(AutoModelForCausalLMWithValueHead):
    """The same for encoder-decoder models (T5, BART): the head reads the decoder's last hidden state."""

    auto_class = AutoModelForSeq2SeqLM

    def _last_hidden_state(self, outputs) -> torch.Tensor:
        return outputs.decoder_hidden_states[-1]


class Critic(AutoModelForCausalLMWithValueHead):
    """A separate value model (OpenRLHF's critic): a transformer trunk without its LM head, and a value head on its last
    hidden state; forward(...) -> values [B, L]. Saved as the trunk (plain `AutoModel.from_pretrained` loads it) and
    value_head.safetensors."""

    def forward(self, logits_to_keep=None, **inputs) -> torch.Tensor:
        return self.v_head(self.pretrained_model(**inputs, use_cache=False).last_hidden_state)


def load_critic(source: str, policy, reward_model, tokenizer, dtype: str, init: str, label=None) -> Critic:
    """ppo.py's --value-model-path: a `Critic` on the trunk of the policy (`policy`), of the run's reward model (`auto`,
    when it reads the policy's tokens: its reward logit becomes the value head, as OpenRLHF starts its critic from the
    reward model; else the policy), of a critic ppo.py saved (its trunk and head), of a sequence classifier (its
    `label` logit), or of any causal LM (a fresh value head, `init`). `reward_model`: the run's `RewardModel`, or None."""
    named, index = source, 0  # the logit of a reward model that starts the values
    if source == "auto":
        same_tokens = reward_model is not None and reward_model.tokenizer.get_vocab() == tokenizer.get_vocab()
        source = reward_model.model if same_tokens else policy.pretrained_model
    elif source == "policy":
        source = policy.pretrained_model
    elif os.path.isfile(os.path.join(source, VALUE_HEAD_FILE)):  # a critic saved by ppo.py: its trunk and head
        source = load_pretrained(source, AutoModel, dtype=dtype), load_file(os.path.join(source, VALUE_HEAD_FILE))
    elif any(a.endswith("ForSequenceClassification") for a in load_config(source).architectures or []):
        source, _, index = load_reward_model(source, label, dtype, flag="--value-model-path")
    else:
        source = load_pretrained(source, AutoModelForCausalLM, dtype=dtype)
    trunk, head = source if isinstance(source, tuple) else (copy.deepcopy(source.base_model), None)
    critic = Critic(trunk.requires_grad_(True), init=init)
    if head is not None:
        critic.v_head.load_state_dict(head)
    elif getattr(source, "score", None) is not None:  # a reward model: its reward logit starts the values
        index = reward_model.index if reward_model and source is reward_model.model else index
        critic.v_head.summary.weight.data.copy_(source.score.weight[index : index + 1])
    if trunk.config.vocab_size != policy.config.vocab_size:
        raise UsageError(
            f"--value-model-path {named}: its vocabulary ({trunk.config.vocab_size} tokens) is not the policy's "
            f"({policy.config.vocab_size}); the critic reads the policy's tokens: pass a model of its tokenizer."
        )
    return critic


class PolicyAndCritic(AutoModelForCausalLMWithValueHead):
    """The policy and its separate critic as one module, forward(...) -> (policy logits, critic values) as the value-head
    policy's: every launcher prepares, shards and checkpoints the two together (TRL 0.11's PolicyAndValueWrapper), one
    Adam with a parameter group each. Saved as the policy (plain from_pretrained format) with the critic in critic/."""

    def __init__(self, policy, critic: Critic):
        torch.nn.Module.__init__(self)
        self.pretrained_model, self.critic, self.config = policy, critic, policy.config

    def forward(self, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pretrained_model(**inputs, use_cache=False).logits, self.critic(**inputs)

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        parts = {"pretrained_model.": None, "critic.": None}
        for prefix in parts if state_dict is not None else ():
            parts[prefix] = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        self.pretrained_model.save_pretrained(save_directory, state_dict=parts["pretrained_model."], **kwargs)
        self.critic.save_pretrained(os.path.join(save_directory, "critic"), state_dict=parts["critic."], **kwargs)


def disable_dropout(model: nn.Module) -> None:
    """Every dropout probability of `model` set to 0 (TRL's disable_dropout): the log-probs of sampling and of training,
    and of the policy and its reference, then agree."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def check_lora_targets(model: nn.Module, targets: list[str] | None) -> None:
    """A one-line error for --lora-target-modules that name no module of `model` (peft matches a name or its suffix)."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets or [] if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UsageError(
            f"--lora-target-modules {' '.join(missing)}: no such module in the model; its linear layers: {leaves}."
        )


class Float32Head(nn.Linear):
    """An LM head whose weights are float32 and whose matmul takes its hidden states in float32 (see cast_lm_head)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(hidden_states.float(), self.weight.float(), bias)


def cast_lm_head(model: nn.Module) -> None:
    """ScaleRL's float32 LM head (TRL 1.16's cast_lm_head_to_fp32), in place: the head's weights in float32 and its
    logits computed in float32 whatever the model's dtype. A head tied to the embeddings shares the float32 weight, and
    the embeddings' output is cast back to the model's dtype. Before LoRA and the reference copy, which inherit it."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise UsageError(f"--cast-lm-head-to-fp32: the model's head is a {type(head).__name__}, not a linear layer.")
    dtype = head.weight.dtype
    head.float().__class__ = Float32Head  # a class, not a bound function: deep copies (the reference) keep their own
    if model.get_input_embeddings().weight is head.weight:  # tied: only the activations go back to the model's dtype
        model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.to(dtype))


def peft_model_of(model: nn.Module) -> PeftModel | None:
    """The PeftModel inside `model` (itself, or the LM of a value-head wrapper), or None."""
    inner = getattr(model, "pretrained_model", model)
    return inner if isinstance(inner, PeftModel) else None


def reference_context(model: nn.Module, ref_model: nn.Module | None):
    """Context in which the reference model runs: for a peft policy (ref_model None) its adapter is off."""
    if ref_model is not None:
        return contextlib.nullcontext()
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise ValueError("ref_model is None but the policy is not a peft model: there is no reference to run.")
    return peft_model.disable_adapter()


# Name of the k-th transformer block's parameters, per architecture family
LAYER_PATTERNS = {
    "gpt2": "transformer.h.{layer}.",
    "gpt-neox": "gpt_neox.layers.{layer}.",
    "llama-style": "model.layers.{layer}.",
    "opt": "model.decoder.layers.{layer}.",
}


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None):
    """A frozen, eval-mode reference copy of `model`, or None for a peft model (whose reference is the model with its
    adapter disabled: `reference_context`). With `num_shared_layers=k`, every parameter before block k (the embeddings
    and blocks 0..k-1) is frozen in the policy and *shared* with the reference (same storage); only the rest is copied.
    `pattern` names block parameters, e.g. "transformer.h.{layer}."; it is guessed for GPT-2, GPT-NeoX, Llama-style
    and OPT models."""
    if peft_model_of(model) is not None:
        return None
    named = list(model.named_parameters())
    memo = {}
    if num_shared_layers is not None:
        if pattern is None:
            pattern = next((p for p in LAYER_PATTERNS.values() if any(p.format(layer=0) in n for n, _ in named)), None)
            if pattern is None:
                raise UsageError(
                    f"Cannot find the transformer blocks of {type(model).__name__} to share: pass pattern= "
                    f"(the parameter-name prefix of block k with {{layer}}, e.g. 'transformer.h.{{layer}}.')."
                )
        marker = pattern.format(layer=num_shared_layers)
        first_unshared = next((i for i, (n, _) in enumerate(named) if marker in n), None)
        if first_unshared is None:
            raise UsageError(
                f"num_shared_layers={num_shared_layers}, but no parameter matches {marker!r}: the model has "
                "fewer blocks than that (sharing all of them would leave nothing to train)."
            )
        for _, param in named[:first_unshared]:
            param.requires_grad_(False)
            memo[id(param)] = param  # deepcopy returns these objects themselves: true sharing
    ref_model = copy.deepcopy(model, memo)
    for param in ref_model.parameters():
        param.requires_grad_(False)
    return ref_model.eval()


@torch.no_grad()
def sync_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """TR-DPO's soft update (Gorbatovski et al. 2024, eq. 5; TRL's SyncRefModelCallback): every reference parameter
    becomes alpha * policy + (1 - alpha) * reference, in place."""
    for ref, param in zip(reference.parameters(), policy.parameters(), strict=True):
        ref.mul_(1.0 - alpha).add_(param.to(ref.dtype), alpha=alpha)


def place_frozen(accelerator, model: nn.Module) -> nn.Module:
    """A frozen model (reference, reward model, teacher) on the run's device: under FSDP2 sharded as the policy is, under
    ZeRO-3 partitioned by a DeepSpeed engine of its own (TRL prepares both likewise), so no rank holds a whole copy. Not
    in accelerate's registry: checkpoints do not store it, it is rebuilt from its source on resume."""
    if getattr(accelerator, "is_fsdp2", False):
        return fsdp2_prepare_model(accelerator, model).eval()
    if getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3:
        import deepspeed

        return deepspeed.initialize(model=model, config=accelerator.state.deepspeed_plugin.deepspeed_config)[0].module.eval()
    return model.to(accelerator.device)


def classifier_pad(tokenizer, model) -> None:
    """A sequence classifier scores a text at its last token that is not `config.pad_token_id`. Where the pad token is
    the EOS (SmolLM2 and many instruct models), a text's own closing EOS would count as padding: the tokenizer and the
    model then get a distinct pad token (the unknown or BOS token, which never ends a text)."""
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        substitute = next((t for t in (tokenizer.unk_token, tokenizer.bos_token) if t and t != tokenizer.eos_token), None)
        if substitute is None:
            raise UsageError(
                f"the tokenizer of {tokenizer.name_or_path!r} pads with its EOS and has no other special token to pad a "
                "reward model's input with: add a distinct pad token (tokenizer.add_special_tokens({'pad_token': "
                "'<|pad|>'}), resize the embeddings) and save both"
            )
        tokenizer.pad_token = substitute
    model.config.pad_token_id = tokenizer.pad_token_id


def load_reward_model(name: str, label: str | None = None, dtype: str = "float32", flag: str = "--reward-model"):
    """A trained sequence classifier in `dtype`, its tokenizer (right padding, a pad distinct from EOS: `classifier_pad`)
    and the index of the logit that is the reward (`label`: a name or an index; None: the single logit of a one-label
    head). A folder whose classification head would be freshly initialised
    (a causal LM such as outputs/sft, a random built-in) is an error: RL against a random head learns nothing real.
    `flag`: the option that named `name`, for the error lines."""
    if is_random_builtin(name):
        raise UsageError(
            f"{flag} {name} is a randomly initialised preset: pass a trained reward model "
            "(builtin:tiny-chat-rm, or a folder written by reward_modeling.py)."
        )
    model, info = load_pretrained(name, AutoModelForSequenceClassification, dtype=dtype, output_loading_info=True)
    if info["missing_keys"]:
        raise UsageError(
            f"{flag} {name} has no trained classification head (its checkpoint lacks "
            f"{sorted(info['missing_keys'])[:4]}): pass a sequence classifier, e.g. a folder written by "
            "reward_modeling.py."
        )
    tokenizer = load_tokenizer(name, padding_side="right")
    classifier_pad(tokenizer, model)
    labels = model.config.id2label if model.config.num_labels > 1 else {}
    if label is None:
        if model.config.num_labels != 1:
            raise UsageError(
                f"{flag} {name} has {model.config.num_labels} labels {list(labels.values())}: "
                "pass --reward-label with the one to maximise (a name or an index)."
            )
        return model.eval(), tokenizer, 0
    index = model.config.label2id.get(label, int(label) if label.isdigit() else None)
    if index is None or not 0 <= index < model.config.num_labels:
        raise UsageError(
            f"--reward-label {label}: {name} has the labels {dict(labels) or {0: 'a single logit'}}; "
            "pass one of their names or indices."
        )
    return model.eval(), tokenizer, index
