"""Small Llama models with LoRA adapters, built from a config with random weights (no download).

Used by ``ds-z3native demo``: a frozen base (every weight of a ``LlamaForCausalLM``) with PEFT
LoRA adapters on its linear layers, the shape of a real LoRA fine-tune at a size a laptop trains
in seconds. :func:`build_lora_model` builds other transformers model types at the same shapes
(GPT-2, mixture-of-experts models, ...), for the benchmarks and tests. Needs the ``demo`` extra
(``pip install -e ".[demo]"``: transformers, peft, tqdm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

__all__ = ["ModelSize", "MODEL_SIZES", "DEFAULT_SIZE", "LORA_TARGETS", "FAMILIES",
           "build_lora_llama", "build_lora_model", "synthetic_batch", "zero3_auto_values"]


@dataclass(frozen=True)
class ModelSize:
    """A named Llama shape, and the batch the demo trains it on."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    batch: int  # sequences per rank and step
    lora_rank: int
    note: str

    def llama_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``transformers.LlamaConfig`` for this size."""
        return dict(hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                    max_position_embeddings=max(self.seq_len, 128), tie_word_embeddings=False)


MODEL_SIZES: Dict[str, ModelSize] = {s.name: s for s in (
    ModelSize("tiny", hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2, vocab=512,
              seq_len=32, batch=2, lora_rank=4, note="seconds on a CPU; used by the tests"),
    ModelSize("small", hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2, vocab=2048,
              seq_len=64, batch=2, lora_rank=8, note="the default"),
    ModelSize("medium", hidden=768, intermediate=2048, layers=8, heads=12, kv_heads=4,
              vocab=8192, seq_len=256, batch=4, lora_rank=16,
              note="~65 M params; a GPU or patience"),
    ModelSize("1b", hidden=2048, intermediate=5632, layers=16, heads=32, kv_heads=8, vocab=32000,
              seq_len=1024, batch=4, lora_rank=16, note="~0.86 B params with LoRA; a GPU"),
)}
DEFAULT_SIZE = "small"

# Every linear layer, the output head included: with random base weights the adapters need a
# direct path to the logits for the loss to fall within a few steps.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head")


def build_lora_llama(size: ModelSize, seed: int = 0) -> Tuple[Any, Dict[str, int]]:
    """A randomly initialised ``LlamaForCausalLM`` of ``size`` wrapped by PEFT LoRA on every
    linear layer (:data:`LORA_TARGETS`); only the adapters train. Returns (model, counts) where
    counts has ``params`` and ``trainable``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**size.llama_kwargs())
    return _with_lora(LlamaForCausalLM(config), size, list(LORA_TARGETS))


def _with_lora(base: Any, size: ModelSize, targets: Any, trained: Tuple[str, ...] = (),
               fan_in_fan_out: bool = False) -> Tuple[Any, Dict[str, int]]:
    """``base`` wrapped by PEFT LoRA of ``size``'s rank on ``targets``, with the params whose
    names end in one of ``trained`` trained in full too; (model, counts) where counts has
    ``params`` and ``trainable``."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=size.lora_rank, lora_alpha=2 * size.lora_rank, lora_dropout=0.0,
                      target_modules=targets, task_type="CAUSAL_LM",
                      fan_in_fan_out=fan_in_fan_out)
    model = get_peft_model(base, lora)
    for name, param in model.named_parameters():
        if trained and name.endswith(trained):
            param.requires_grad_(True)
    counts = {"params": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    return model, counts


# Decoder families build_lora_model makes at a ModelSize's shape, beyond any transformers
# model_type whose config takes Llama's names (LoRA on every linear layer, "all-linear"): per
# model_type, the LoRA targets a user picks for it, params trained in full beside the adapters
# (``trained``) and config keywords beyond the shape. gpt2: its own config names, Conv1D layers,
# a class name that names no loss (GPT2LMHeadModel); qwen3_moe and mixtral: mixture-of-experts
# blocks (ZeRO-3 leaf modules by DeepSpeed's default) with LoRA on attention and the router
# trained in full, the experts frozen (PEFT puts LoRA on fused expert weights through
# torch.nn.utils.parametrize, which Dynamo cannot trace).
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": {"targets": LORA_TARGETS},
    "gpt2": {"targets": ("c_attn", "c_proj", "c_fc")},
    "qwen3_moe": {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
                  "trained": ("mlp.gate.weight",),
                  "config": {"num_experts": 4, "num_experts_per_tok": 2}},
    "mixtral": {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "trained": ("mlp.gate.weight",),
                "config": {"num_local_experts": 4, "num_experts_per_tok": 2}},
}


def _family_config(size: ModelSize, family: str) -> Any:
    import inspect

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        raise ValueError(f"build_lora_model: {family!r} is not a model type this transformers "
                         f"knows (a config's model_type: llama, gpt2, qwen3_moe, mistral, ...)")
    if family == "gpt2":
        # GPT-2's own names; dropout off (the Llama-shaped families have none by default), so
        # that compiled and eager runs draw no random masks.
        kwargs: Dict[str, Any] = dict(
            n_embd=size.hidden, n_inner=size.intermediate, n_layer=size.layers, n_head=size.heads,
            vocab_size=size.vocab, n_positions=max(size.seq_len, 128), tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        kwargs = dict(size.llama_kwargs())
        # Where the config takes them (FalconConfig's head_dim is a read-only property): the
        # shape's head size, and an expert's width for mixture-of-experts configs.
        accepted = inspect.signature(CONFIG_MAPPING[family].__init__).parameters
        for name, value in (("head_dim", size.hidden // size.heads),
                            ("moe_intermediate_size", size.intermediate // 2)):
            if name in accepted:
                kwargs[name] = value
    kwargs.update(FAMILIES.get(family, {}).get("config", {}))
    config = AutoConfig.for_model(family, **kwargs)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= size.vocab:  # a default of the full vocabulary
            setattr(config, name, 0)
    return config


def build_lora_model(size: ModelSize, family: str = "llama", seed: int = 0
                     ) -> Tuple[Any, Dict[str, int]]:
    """A randomly initialised causal LM of transformers model type ``family`` at ``size``'s
    shape, wrapped by PEFT LoRA, as :data:`FAMILIES` says for it (another model type: a config
    with Llama's names, LoRA on every linear layer); the adapters train, and the family's
    ``trained`` params (an MoE router) in full. ``family="llama"`` is :func:`build_lora_llama`.
    A model type transformers does not know raises ``ValueError``. Returns (model, counts)."""
    if family == "llama":
        return build_lora_llama(size, seed)
    import torch
    from transformers import AutoModelForCausalLM

    spec = FAMILIES.get(family, {"targets": "all-linear"})
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(_family_config(size, family))
    targets = spec["targets"]
    return _with_lora(base, size, targets if isinstance(targets, str) else list(targets),
                      trained=tuple(spec.get("trained", ())), fan_in_fan_out=family == "gpt2")


def synthetic_batch(size: ModelSize, step: int, rank: int, seed: int = 0) -> Any:
    """Token ids ``[batch, seq_len]`` for one rank and step: counting sequences
    (``t[i+1] = t[i] + stride mod vocab``) from a small fixed pool, so the loss can fall within a
    few steps. Deterministic in (seed, step, rank)."""
    import torch

    pool = 4  # distinct sequences; every step draws from the same few, so they get memorised
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, size.vocab, (pool,), generator=g)
    strides = torch.randint(1, 7, (pool,), generator=g)
    pick = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    rows = torch.randint(0, pool, (size.batch,), generator=pick)
    pos = torch.arange(size.seq_len)
    return (starts[rows, None] + strides[rows, None] * pos[None, :]) % size.vocab


def zero3_auto_values(hidden: int) -> Dict[str, int]:
    """What HF Trainer's ``"auto"`` gives ZeRO-3's size settings for a model of this hidden size
    (so that the demo's small weights are partitioned the way a large model's are)."""
    return {"reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
