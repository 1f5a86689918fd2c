"""Shared helpers of the algorithm scripts: log-prob/masking/KL utilities, KL controllers, value-head and
reference models, loading by name (hub id, local path or one of the offline built-in presets), run setup.
Everything algorithm-specific stays in the scripts."""

from common.core import (
    INVALID_LOGPROB,
    AdaptiveKLController,
    FastGenerator,
    FixedKLController,
    InverseCDFSampler,
    LogitMask,
    RunningMoments,
    UsageError,
    check_args,
    check_scores,
    chunkable_head,
    chunked_logprobs,
    clip_by_value,
    entropy_from_logits,
    exact_div,
    kl_estimate,
    lm_token_logprobs,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    pad_right,
    sampling_kwargs,
    weight_decay_groups,
)
from common.loading import (
    check_columns,
    context_length,
    is_conversation,
    load_config,
    load_data,
    load_pipeline,
    load_pretrained,
    load_tokenizer,
    quantization_kwargs,
    reward_model_text,
    train_eval_split,
)
from common.models import (
    REWARD_NORMALIZATION_FILE,
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    create_reference_model,
    load_reward_model,
    peft_model_of,
    reference_context,
)
from common.run import (
    RunLogger,
    atomic_directory,
    cli,
    end_run,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    start_run,
    write_model_card,
)
