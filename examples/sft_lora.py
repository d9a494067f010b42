"""LoRA fine-tune of a Llama under DeepSpeed ZeRO-3 with HF Trainer or TRL's SFTTrainer.

Nothing in it is specific to ds_z3native: it is an ordinary Trainer script. The fixes come from
the environment (``DS_Z3NATIVE=1``) and DeepCompile from the DeepSpeed config
(``ds_z3_deepcompile.json``) plus ``--torch-compile``:

    DS_Z3NATIVE=1 accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/sft_lora.py --deepspeed examples/ds_z3_deepcompile.json --torch-compile
    DS_Z3NATIVE=1 torchrun --nproc_per_node 2 examples/sft_lora.py --deepspeed examples/ds_z3.json

Without ``--model`` it builds a small Llama from a config with random weights and trains it on
synthetic token sequences (nothing is downloaded); with ``--model NAME_OR_PATH`` it loads that
model (and its tokenizer). ``--data text`` trains on the instruction/response pairs of
``examples/data/instructions.jsonl`` instead (its last 10% is the evaluation split), tokenized by
a byte-level BPE tokenizer trained on its training rows at start-up (or ``--model``'s tokenizer);
rows have their own lengths and each batch is padded to its longest row. ``--qlora`` loads the
base model in 4 bits (bitsandbytes nf4 with double quantization) with its quantized weights stored
in the compute dtype (``bnb_4bit_quant_storage``), which ZeRO-3 partitions as it does any float
param; the model built from a config is saved to a temporary directory first and loaded from there
quantized. ``--results FILE``
writes the logged losses, the evaluation losses, where the adapter was saved (and the adapter as
initialised, before the first step), how many distinct batch lengths training saw and whether
ds_z3native was installed in the process, as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

# Sizes of the models built from a config (hidden, intermediate, layers, heads, kv heads, vocab).
SIZES = {
    "tiny": (128, 352, 2, 4, 2, 512),
    "small": (256, 704, 4, 4, 2, 2048),
    "1b": (2048, 5632, 16, 32, 8, 32000),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --data text: instruction/response pairs, one JSON object a line; the last EVAL_FRACTION of the
# rows is the evaluation split. A row is PROMPT_TEMPLATE.format(prompt=...) + response + eos.
TEXT_DATA = Path(__file__).resolve().parent / "data" / "instructions.jsonl"
EVAL_FRACTION = 0.1
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
PAD, EOS = "<pad>", "</s>"
SEQ_LEN = {"counting": 32, "text": 128}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("hf", "trl"), default="hf",
                   help="transformers.Trainer or trl.SFTTrainer (default: hf)")
    p.add_argument("--deepspeed", help="DeepSpeed config file (ZeRO-3: examples/ds_z3.json)")
    p.add_argument("--model", help="a model name or path to load; default: a Llama built from "
                                   "a config (--size) with random weights")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--output-dir", default="out/sft_lora")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=2, help="per device")
    p.add_argument("--data", choices=("counting", "text"), default="counting",
                   help="counting: synthetic token sequences (default); text: the instruction "
                        "pairs of examples/data/instructions.jsonl, last 10%% for evaluation")
    p.add_argument("--data-file", default=str(TEXT_DATA),
                   help="text: a jsonl of {\"prompt\": ..., \"response\": ...} lines "
                        "(default: examples/data/instructions.jsonl)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="counting: the rows' length; text: rows are truncated at it "
                        "(default: 32 counting, 128 text)")
    p.add_argument("--variable-length", action="store_true",
                   help="counting: each row's length drawn from [seq-len/4, seq-len], batches "
                        "padded to their longest row (text rows always have their own lengths)")
    p.add_argument("--completion-only-loss", action="store_true",
                   help="text: loss on the response tokens only (labels -100 on the prompt)")
    p.add_argument("--packing", action="store_true",
                   help="TRL with text: SFTConfig(packing=True) (packs rows into --seq-len "
                        "sequences, padding-free)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: the base model loaded in 4 bits through bitsandbytes (nf4, double "
                        "quantization, quant storage = compute dtype: bf16 with --bf16, else fp32)")
    p.add_argument("--quant-storage", choices=("compute", "uint8"), default="compute",
                   help="--qlora: store the 4-bit weights in the compute dtype (default; what "
                        "ZeRO-3 partitions as a float param) or in uint8 (bitsandbytes' default)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing",
                   action="store_false", help="(default: non-reentrant checkpointing on)")
    p.add_argument("--torch-compile", action="store_true",
                   help="TrainingArguments(torch_compile=True): with a DeepCompile config, "
                        "accelerate calls engine.compile()")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="resume from the last checkpoint in --output-dir, or from the one given")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="write losses and the adapter's path here (JSON, rank 0)")
    args = p.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = SEQ_LEN[args.data]
    if args.variable_length and args.data != "counting":
        p.error("--variable-length is for --data counting (text rows have their own lengths)")
    if args.completion_only_loss and args.data != "text":
        p.error("--completion-only-loss needs --data text (counting rows have no prompt)")
    if args.packing and (args.trainer != "trl" or args.data != "text"):
        p.error("--packing needs --trainer trl --data text")
    if args.quant_storage != "compute" and not args.qlora:
        p.error("--quant-storage is for --qlora")
    return args


def synthetic_dataset(n: int, seq_len: int, vocab: int, seed: int,
                      variable_length: bool = False) -> List[Dict[str, List[int]]]:
    """Counting sequences (t[i+1] = t[i] + stride mod vocab) from random starts: rows of
    ``input_ids`` (any sized sequence of dicts serves HF Trainer; TRL takes a datasets.Dataset).
    ``variable_length``: each row cut to a length drawn from [seq_len // 4, seq_len] (the same
    rows' first tokens as without it)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n,), generator=g)
    strides = torch.randint(1, 7, (n,), generator=g)
    ids = (starts[:, None] + strides[:, None] * torch.arange(seq_len)[None, :]) % vocab
    rows = ids.tolist()
    if variable_length:
        lengths = torch.randint(max(1, seq_len // 4), seq_len + 1, (n,), generator=g).tolist()
        rows = [row[:length] for row, length in zip(rows, lengths)]
    return [{"input_ids": row} for row in rows]


def instruction_rows(path: Path = TEXT_DATA) -> Tuple[List[Dict[str, str]], List[Dict[str, str]]]:
    """(train, eval) rows of ``prompt`` (the template applied) and ``completion`` (the response)
    from the jsonl; the evaluation split is its last EVAL_FRACTION, fixed."""
    with open(path) as f:
        pairs = [json.loads(line) for line in f if line.strip()]
    rows = [{"prompt": PROMPT_TEMPLATE.format(prompt=r["prompt"]), "completion": r["response"]}
            for r in pairs]
    n_eval = max(1, int(len(rows) * EVAL_FRACTION))
    return rows[:-n_eval], rows[-n_eval:]


def text_tokenizer(rows: List[Dict[str, str]], vocab: int) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab`` tokens trained on ``rows`` (deterministic:
    every rank and every run builds the same one, in well under a second), pad ``<pad>`` (id 0)
    and eos ``</s>`` (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([r["prompt"] + r["completion"] for r in rows], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def tokenized_rows(rows: List[Dict[str, str]], tokenizer: Any,
                   seq_len: int) -> List[Dict[str, Any]]:
    """HF Trainer's text rows: ``input_ids`` = prompt + response + eos, truncated at ``seq_len``,
    and ``prompt_len`` (the tokens --completion-only-loss leaves out of the loss)."""
    out = []
    for r in rows:
        prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
        ids = (prompt + answer + [tokenizer.eos_token_id])[:seq_len]
        out.append({"input_ids": ids, "prompt_len": min(len(prompt), seq_len)})
    return out


def word_tokenizer(vocab: int) -> Any:
    """A tokenizer built in memory (token ``t<i>`` is id i): what TRL needs beside a model built
    from a config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 1)}
    words["<pad>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


def build_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        if args.qlora:
            return quantized_model(args.model, args)
        # Under ZeRO-3 transformers loads the weights straight into partitions (zero.Init).
        return AutoModelForCausalLM.from_pretrained(args.model)
    hidden, inter, layers, heads, kv, vocab = SIZES[args.size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=max(args.seq_len, 128), tie_word_embeddings=False)
    # Random weights drawn whole, the same at every rank and every ZeRO stage
    # (AutoModelForCausalLM.from_config would draw them inside zero.Init's partitioning);
    # deepspeed.initialize partitions them.
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    if not args.qlora:
        return model
    import tempfile

    from safetensors.torch import save_file

    # bitsandbytes quantizes weights as from_pretrained loads them: load the drawn ones quantized,
    # each rank from its own copy (save_pretrained writes on rank 0 only).
    with tempfile.TemporaryDirectory(prefix="sft_lora_base_") as base:
        model.config.save_pretrained(base)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
        del model
        return quantized_model(base, args)


def quantized_model(name: str, args: argparse.Namespace) -> Any:
    """``name`` loaded with its linear layers in 4 bits (bitsandbytes nf4, double quantization),
    computing in bf16 with --bf16 (else fp32), the packed weights stored in that dtype (or in
    uint8 with ``--quant-storage uint8``), on this rank's device. The model is not cast to fp32
    for k-bit training (PEFT's prepare_model_for_kbit_training): ZeRO-3 wants one float dtype,
    and the trainer turns checkpointing on itself."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = torch.bfloat16 if args.bf16 else torch.float32
    storage = compute if args.quant_storage == "compute" else torch.uint8
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute,
                               bnb_4bit_quant_storage=storage)
    # No device_map (ZeRO-3 refuses one): transformers puts the model on this rank's current
    # device, which the training arguments set.
    return AutoModelForCausalLM.from_pretrained(name, quantization_config=quant, dtype=compute)


class LossRecorder:
    """Collects what the trainer logs (training and evaluation losses, by step)."""

    def __init__(self) -> None:
        self.train: List[List[float]] = []
        self.eval: List[List[float]] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class _Record(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict] = None,
                       **kwargs: Any) -> None:
                logs = logs or {}
                if "loss" in logs:
                    recorder.train.append([state.global_step, float(logs["loss"])])
                if "eval_loss" in logs:
                    recorder.eval.append([state.global_step, float(logs["eval_loss"])])

        return _Record()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                      target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    common = dict(
        output_dir=args.output_dir, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        max_grad_norm=args.max_grad_norm, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, report_to=[], seed=args.seed, data_seed=args.seed, bf16=args.bf16,
        deepspeed=args.deepspeed, torch_compile=args.torch_compile,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        dataloader_num_workers=0,
    )
    if args.deepspeed and not torch.cuda.is_available():
        common["accelerator_config"] = {"use_configured_state": _cpu_deepspeed_state()}
    vocab = SIZES[args.size][5]
    if args.trainer == "trl":
        from trl import SFTConfig, SFTTrainer

        if args.data == "text":  # SFTTrainer tokenizes, truncates (and packs) the text rows
            targs = SFTConfig(**common, max_length=args.seq_len, packing=args.packing,
                              completion_only_loss=args.completion_only_loss)
        else:
            targs = SFTConfig(**common, max_length=args.seq_len, packing=False,
                              dataset_kwargs={"skip_prepare_dataset": True})
    else:
        from transformers import TrainingArguments

        targs = TrainingArguments(**common)
    model = build_model(args)
    if args.model:
        vocab = model.config.vocab_size
    tokenizer = None
    if args.data == "text":
        train, evals = instruction_rows(Path(args.data_file))
        tokenizer = _model_tokenizer(args.model) if args.model else text_tokenizer(train, vocab)
    else:
        train = synthetic_dataset(64, args.seq_len, vocab, args.seed, args.variable_length)
        evals = synthetic_dataset(8, args.seq_len, vocab, args.seed + 1, args.variable_length)
    recorder = LossRecorder()
    if args.trainer == "trl":
        from datasets import Dataset

        if tokenizer is None:
            tokenizer = _model_tokenizer(args.model) if args.model else word_tokenizer(vocab)
        trainer = SFTTrainer(model=model, args=targs, train_dataset=Dataset.from_list(train),
                             eval_dataset=Dataset.from_list(evals) if args.eval_steps else None,
                             processing_class=tokenizer, peft_config=lora,
                             callbacks=[recorder.callback()])
    else:
        from transformers import Trainer

        model = get_peft_model(model, lora)
        if args.data == "text":
            train = tokenized_rows(train, tokenizer, args.seq_len)
            evals = tokenized_rows(evals, tokenizer, args.seq_len)
            collate = padding_collator(tokenizer.pad_token_id, args.completion_only_loss)
        elif args.variable_length:
            collate = padding_collator(0)
        else:
            collate = _causal_lm_collator()
        trainer = Trainer(model=model, args=targs, train_dataset=train,
                          eval_dataset=evals if args.eval_steps else None, data_collator=collate,
                          callbacks=[recorder.callback()])
    lengths = _count_batch_lengths(trainer)
    # The adapter as initialised, for what --results reports (how far training moved it).
    initial_dir = os.path.join(args.output_dir, "adapter-initial") if args.results else None
    if initial_dir:
        _save_initial_adapter(trainer, initial_dir)
    trainer.train(resume_from_checkpoint=args.resume)
    adapter_dir = os.path.join(args.output_dir, "adapter")
    trainer.save_model(adapter_dir)
    if args.results and trainer.is_world_process_zero():
        with open(args.results, "w") as f:
            json.dump({"train_loss": recorder.train, "eval_loss": recorder.eval,
                       "global_step": trainer.state.global_step, "adapter": adapter_dir,
                       "initial_adapter": initial_dir, "bf16": args.bf16, "lr": args.lr,
                       "ds_z3native_installed": _ds_z3native_installed(),
                       "total_flos": trainer.state.total_flos,
                       "trainer": args.trainer, "data": args.data, "qlora": args.qlora,
                       "variable_length": args.variable_length or args.data == "text",
                       "distinct_lengths": len(lengths)}, f)
    if not torch.cuda.is_available() and torch.distributed.is_initialized():
        _leave_cpu_ranks()
    return 0


def _cpu_deepspeed_state() -> bool:
    """DeepSpeed on CPU ranks (DS_ACCELERATOR=cpu; how CI runs this script): accelerate counts
    DeepSpeed's ranks only when it picks a backend itself, which it does for GPUs. Configure its
    state on gloo first (True: the trainer is to use it). DeepSpeed's shared-memory collectives
    for CPU ranks are JIT-compiled at first use (minutes); gloo's serve here."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return True


def _leave_cpu_ranks() -> None:
    """End a finished run on CPU ranks without the interpreter's teardown. Once torch._dynamo is
    imported (DeepSpeed imports it), torch keeps the gloo process group alive after
    destroy_process_group(); a gloo worker thread still dropping its last work then takes the GIL
    during teardown and the process ends in std::terminate (SIGABRT after the run had finished,
    now and then; NCCL ranks are not affected)."""
    import sys

    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_initial_adapter(trainer: Any, path: str) -> None:
    """The adapter as initialised (rank 0 writes it, in save_model's format): what training moved
    it from. Params already partitioned (a --model loaded under ZeRO-3) are gathered first, on
    every rank."""
    import contextlib

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    gather: Any = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        if trainer.is_world_process_zero():
            trainer.model.save_pretrained(path)


def _ds_z3native_installed() -> bool:
    """Whether ds_z3native's patches were in effect in this process (DS_Z3NATIVE=1)."""
    module = sys.modules.get("ds_z3native")
    return bool(module is not None and module.installed())


def _model_tokenizer(name: str) -> Any:
    """--model's tokenizer, with a pad token (its eos where it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _count_batch_lengths(trainer: Any) -> set:
    """The padded lengths of the batches this rank trains on (``input_ids.shape[-1]`` at each
    ``training_step``; evaluation batches, which go through the same collator, are not counted)."""
    seen: set = set()
    step = trainer.training_step

    def training_step(model: Any, inputs: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        seen.add(int(inputs["input_ids"].shape[-1]))
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    return seen


def padding_collator(pad_id: int, completion_only_loss: bool = False) -> Any:
    """Batches of rows of their own lengths, right-padded to the longest row of the batch with
    ``pad_id``: ``attention_mask`` 0 and ``labels`` -100 on the pads (and, with
    ``completion_only_loss``, on each row's first ``prompt_len`` tokens)."""

    def collate(rows: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        labels = torch.full((len(rows), longest), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = ids[i, :n]
            if completion_only_loss:
                labels[i, :r.get("prompt_len", 0)] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def _causal_lm_collator() -> Any:
    """Batches of equal-length sequences; labels are the inputs (the model shifts them)."""

    def collate(rows: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone()}

    return collate


if __name__ == "__main__":
    raise SystemExit(main())
