"""Model and tokenizer builders: the one place weights and tokenizers come from.

Role: build the tokenizer (loaded next to the weights, or a character-level one built in code for
tiny models), the policy model (from a volume path, the hub, or random weights from a small config)
with LoRA adapters or full fine-tuning, and the plain state dict rollout engines load. Callers:
`rljob_trainer.train.trainer` (training ranks), `rljob_trainer.engines.transformers_engine` (CPU engine),
`rljob_trainer.driver` (tokenizer for prompts and rewards), tests.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from rljob_trainer import config as config_mod
from rljob_trainer.model import precision

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

CHARSETS: dict[str, str] = {
    "builtin-char": "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c") + "\n",
    "builtin-digits": "0123456789+-*=# ",
}

# A minimal chat template for the printable-ASCII tokenizer, so `data.chatTemplate` runs on tiny models.
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer(charset: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `charset` (ids: specials first, then chars in order).

    No merges and no normaliser, so `decode(encode(s)) == s` for any string over the charset.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )


def tiny_hf_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    model_type: str = "qwen2",
) -> dict[str, Any]:
    """A small decoder-only config dict (Qwen2 layout by default) for tests and the toy task. Heads of
    32 by default: vLLM's CPU attention takes head sizes of 32 and up only (`engines.platform`)."""
    return {
        "model_type": model_type,
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }


def load_tokenizer(settings: config_mod.ModelSettings) -> PreTrainedTokenizerFast:
    """The tokenizer for `settings`: built in code (builtin-*) or loaded next to the weights."""
    if settings.tokenizer in CHARSETS:
        tok = build_char_tokenizer(CHARSETS[settings.tokenizer])
        if settings.tokenizer == "builtin-char":
            tok.chat_template = CHAR_CHAT_TEMPLATE
        return tok
    from transformers import AutoTokenizer

    src, kwargs = _source(settings)
    tok = AutoTokenizer.from_pretrained(src, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _source(settings: config_mod.ModelSettings) -> tuple[str, dict[str, Any]]:
    if settings.source == "pvc":
        return str(settings.path), {}
    if settings.source == "hub":
        token = os.environ.get(settings.hub_token_env) if settings.hub_token_env else None
        kwargs: dict[str, Any] = {"token": token} if token else {}
        if settings.hub_revision:  # a pinned commit, never silently main
            kwargs["revision"] = settings.hub_revision
        return str(settings.hub_id), kwargs
    raise ValueError(f"model.source {settings.source!r} has no weights to load; build it from hfConfig")


def build_base_model(
    settings: config_mod.ModelSettings, *, init_seed: int, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """The base causal LM (no adapters). Tiny models get deterministic random weights from `init_seed`."""
    model = _build(
        settings, AutoModelForCausalLM, init_seed=init_seed, attn_implementation=attn_implementation
    )
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def build_reward_model(settings: config_mod.ModelSettings, *, init_seed: int) -> PreTrainedModel:
    """A reward model (`judge.kind` rewardModel): a sequence-classification model, its score head on
    the last token. A tiny one is built with one label and deterministic random weights; a loaded
    one keeps what its config.json says (`engines.reward_model` refuses other than one label)."""
    from transformers import AutoModelForSequenceClassification

    hf = settings.hf_config or {}
    labels = {} if "id2label" in hf or "num_labels" in hf else {"num_labels": 1}
    return _build(settings, AutoModelForSequenceClassification, init_seed=init_seed, tiny_config=labels)


def _build(
    settings: config_mod.ModelSettings,
    auto_class: Any,
    *,
    init_seed: int,
    tiny_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """`auto_class`'s model of `settings`: random weights from `init_seed` for a tiny source (the same
    seed on every rank and engine gives identical initial weights everywhere; `tiny_config` added to
    its config), else loaded."""
    dtype = precision.compute_dtype(settings.dtype)
    if settings.source == "tiny":
        hf = dict(settings.hf_config or {})
        hf.pop("architectures", None)  # the auto class decides the head
        model_type = hf.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **hf, **(tiny_config or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            return auto_class.from_config(cfg, dtype=dtype, **kwargs)
    src, source_kwargs = _source(settings)
    return auto_class.from_pretrained(src, dtype=dtype, **kwargs, **source_kwargs)


def apply_finetune_mode(model: PreTrainedModel, settings: config_mod.ModelSettings) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters (peft) or leave every parameter trainable (full FT)."""
    if settings.finetune == "full":
        model.requires_grad_(True)
        return model
    from peft import get_peft_model

    return get_peft_model(model, peft_lora_config(settings))


def peft_lora_config(settings: config_mod.ModelSettings) -> Any:
    """The trainer's `peft.LoraConfig` (also what `lora_adapter.write_peft_adapter` saves for vLLM)."""
    from peft import LoraConfig

    lora = settings.lora
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors: gather the full tensor before handing it to an engine.
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _to_cpu(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    full = _full_tensor(t).detach()
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    return full.to("cpu").clone()


def iter_engine_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the base model's naming, LoRA merged in, detached on CPU, floating
    tensors in `dtype` (the job's: the trainer's masters are fp32, engines and exports get the dtype).

    With LoRA, adapters are merged for the read and unmerged afterwards, so the trainer's weights
    are unchanged. Engines load these names with `load_state_dict` (CPU) or `load_weights` (vLLM).
    """
    if is_lora(model):
        model.merge_adapter()
        try:
            base = model.get_base_model()
            for name, t in base.state_dict().items():
                if "lora_" in name:
                    continue
                yield name.replace(".base_layer.", "."), _to_cpu(t, dtype)
        finally:
            model.unmerge_adapter()
    else:
        for name, t in model.state_dict().items():
            yield name, _to_cpu(t, dtype)
