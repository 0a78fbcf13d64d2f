"""Settings of an ``oomb`` run around the engine: model, data, training, output, and each measuring command.

One dataclass per concern, each field declared once with its default, its docstring and its check; the
``oomb`` flags are generated from them (:mod:`oomb.config.flags`) and a YAML file holds the same fields in
sections (``model:``, ``data:``, ``engine:``, ``train:``, ``output:``, ``validation:``, ...; :mod:`oomb.config.io`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import List, Literal, Optional

from . import _checks as check
from .engine import OOMBConfig
from .errors import ConfigError, literal
from .meta import flag

__all__ = [
    "BenchConfig", "DataConfig", "DataMakeConfig", "DataReportConfig", "EvalConfig", "GradErrorConfig", "JobConfig", "MergeConfig",
    "ModelConfig", "OPTIMIZERS", "OutputConfig", "PlanConfig", "SHARDS", "TrainConfig", "SEED_LIMIT", "ValidationConfig",
    "resolve_dtype",
]

SEED_LIMIT = 2**32
"""Seeds are integers from 0 to SEED_LIMIT - 1 (what numpy and torch accept alike)."""

Device = Literal["cpu", "cuda"]
Optimizer = Literal["adamw", "adamw8bit", "adamw-bf16", "adamw-cpu"]
OPTIMIZERS = ("adamw", "adamw8bit", "adamw-bf16", "adamw-cpu")
"""The optimizers ``train.optimizer`` names (:func:`oomb.train.optim.build_optimizer` builds them)."""
Dtype = Literal["auto", "float32", "bfloat16"]
Shard = Literal["none", "params", "grads-optim"]
SHARDS = ("none", "params", "grads-optim")
"""What ``train.shard`` shards over the ranks of torchrun (:func:`oomb.engine.sharding.shard_model`)."""


def resolve_dtype(dtype: str, device: str) -> str:
    """The parameter dtype of a run whose ``model.dtype`` is ``dtype`` on ``device`` ('cpu' or 'cuda'), as
    ``ModelConfig.dtype`` documents it: 'float32' or 'bfloat16' as given; 'auto' is 'bfloat16' on 'cuda' and
    'float32' on 'cpu'. The one rule of every command (train, plan, eval, grad-error, bench, merge): a plan of a
    run counts the bytes the run allocates. Needs no GPU (a plan for a CUDA run is made anywhere)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def _in(section: str, first=None):
    """``__post_init__`` of the section at key path ``section``: ``first``'s checks (those of a value the type check
    would tell less well), the field types (:func:`check.types`), then ``fn``'s checks; a :class:`ConfigError` is
    told in ``section``."""
    def wrap(fn):
        def post_init(self) -> None:
            try:
                if first is not None:
                    first(self)
                check.types(self)
                fn(self)
            except ConfigError as exc:
                exc.section = exc.section or section
                raise
        return post_init
    return wrap


def _rope_scaling_is_text(value) -> None:
    """``rope_scaling`` is one string of key=value pairs (:func:`oomb.models.rope.parse_rope_scaling` reads it, as
    the flag gives it); a mapping, the form a YAML file invites, is told as that string."""
    if value is None or isinstance(value, str):
        return
    if isinstance(value, dict) and value:
        example = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items())
        raise ConfigError("rope_scaling", f"{{rope_scaling}} is the mapping {literal(value)}",
                          "write it as one string of key=value pairs: " + example.replace("{", "{{").replace("}", "}}"))
    raise ConfigError("rope_scaling", f"{{rope_scaling}} is {literal(value)}",
                      "write it as one string of key=value pairs, e.g. type=linear,factor=2 or "
                      "type=yarn,factor=4,original_max_position_embeddings=32768")


@dataclass
class ModelConfig:
    """The model: which one, its dtype and device, and what of it is trained."""

    name: str = field(default="tiny", metadata=flag("--model"))
    """A preset (tiny, tiny-llama, tiny-mistral, tiny-qwen3, qwen2.5-0.5b, qwen2.5-7b, qwen2.5-32b, qwen2.5-72b; random weights) or a
    local Hugging Face model directory; nothing is downloaded. A bare preset name always means the preset, so
    write a local folder of that name as a path (./tiny)."""

    device: Device = "cpu"
    """Where to run."""

    dtype: Dtype = "auto"
    """Parameter dtype; auto: bfloat16 on cuda, float32 on cpu."""

    seed: int = 0
    """Seed of the random weights of a preset, the LoRA init, the data order and the benchmark tokens."""

    rope_theta: Optional[float] = None
    """Set the model's RoPE base frequency (saved in config.json)."""

    rope_scaling: Optional[str] = field(default=None, metadata=flag("--rope-scaling", metavar="SPEC"))
    """Hugging Face RoPE scaling as key=value pairs, e.g.
    'type=yarn,factor=4,original_max_position_embeddings=32768' (types: linear, dynamic, yarn, llama3, ...;
    saved in config.json)."""

    lora_rank: int = 0
    """LoRA rank (peft) on the layers lora_targets names; 0: full fine-tune. A rank above every q/k/v/o
    projection's smaller dimension is refused (an adapter that large expresses nothing a full update cannot, in
    any of them)."""

    lora_alpha: Optional[float] = None
    """LoRA alpha; default: 2 x lora_rank."""

    lora_targets: str = field(default="q_proj,k_proj,v_proj,o_proj", metadata=flag("--lora-targets", metavar="NAMES"))
    """The linear layers a LoRA adapter adapts: a comma list of module names (q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj in Qwen/Llama/Mistral models), or all-linear (every linear layer but the output
    projection)."""

    train_embeddings_norms: bool = False
    """With LoRA, also train the input embeddings and every norm layer (LongLoRA: LoRA alone does not extend the
    context); they are saved in the adapter (peft modules_to_save), which PeftModel.from_pretrained loads."""

    @_in("model", first=lambda self: _rope_scaling_is_text(self.rope_scaling))
    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", f"{{name}} is {literal(self.name)}", "pass a preset name or a model folder")
        check.choice("device", self.device, ("cpu", "cuda"))
        check.choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        if not check.is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError("seed", f"{{seed}} is {literal(self.seed)}", f"pass an integer from 0 to {SEED_LIMIT - 1}")
        if self.rope_theta is not None:
            check.positive_float("rope_theta", self.rope_theta, "pass a positive base frequency, e.g. {rope_theta} 1000000")
        check.nonnegative_int("lora_rank", self.lora_rank, zero="0 for a full fine-tune", unit="")
        if self.lora_alpha is not None:
            check.positive_float("lora_alpha", self.lora_alpha, "pass a positive number (default: 2 x {lora_rank})")
            if self.lora_rank == 0:
                raise ConfigError("lora_alpha", "{lora_alpha} scales a LoRA adapter but {lora_rank} is 0 (a full fine-tune)",
                                  "set {lora_rank} R, or leave {lora_alpha} out")
        if not isinstance(self.lora_targets, str) or not all(n.strip() for n in self.lora_targets.split(",")):
            empty = isinstance(self.lora_targets, str) and any(n.strip() for n in self.lora_targets.split(","))
            raise ConfigError("lora_targets", f"{{lora_targets}} is {literal(self.lora_targets)}"
                              + (", which has an empty name" if empty else ""),
                              "pass module names separated by commas (e.g. q_proj,v_proj) or all-linear")
        check.boolean("train_embeddings_norms", self.train_embeddings_norms)
        if self.lora_rank == 0:
            defaults = {f.name: f.default for f in fields(self)}
            for key in ("lora_targets", "train_embeddings_norms"):
                if getattr(self, key) != defaults[key]:
                    raise ConfigError(key, f"{{{key}}} sets up a LoRA adapter but {{lora_rank}} is 0 (a full fine-tune, "
                                      "which trains every layer)", f"set {{lora_rank}} R, or leave {{{key}}} out")


@dataclass
class DataConfig:
    """The training or evaluation text and how it becomes token sequences."""

    path: Optional[str] = field(default=None, metadata=flag("--data"))
    """Local data: a text file (one document), a json/jsonl, parquet, csv or arrow file, a folder of data files
    of one format (subfolders included; each .txt file one document; a folder mixing formats is refused), or a
    Dataset.save_to_disk folder (read with the datasets library); default: the bundled Austen corpus."""

    split: str = field(default="train", metadata=flag("--data-split"))
    """The split of the data to read (a single file's one split is train; for oomb eval, e.g. validation or test)."""

    format: Literal["auto", "text", "messages", "prompt-completion", "segments"] = field(
        default="auto", metadata=flag("--data-format"))
    """How rows are read: text (the text_field), messages (a list of role/content messages rendered with the
    chat template), prompt-completion (prompt and completion fields), segments (a list of {"text", "label"}
    pieces, those labelled true trained); auto: from the fields the rows have, in that order of preference
    messages, prompt-completion, segments, text."""

    text_field: str = "text"
    """The field holding the text of a text row; with format auto, a field other than text is refused where the
    rows lack it or are of another format (messages, prompt-completion, segments): they are not read in its place,
    nor is it ignored (format text reads it from any rows); with one of those formats named, it is refused. Plain text (a .txt file, a folder of them, the
    bundled corpus) has no fields: it reads as the one field text, and naming another is refused."""

    chat_template: Optional[str] = field(default=None, metadata=flag("--chat-template", metavar="PATH"))
    """A Jinja chat template file (or a JSON file with a "chat_template" key) to render messages with, instead
    of the tokenizer's own; needed when the tokenizer has none. Refused with text and segments rows, which are not rendered."""

    loss_on: Optional[Literal["all", "assistant"]] = None
    """Which tokens of a chat, prompt-completion or segments example carry the loss: assistant (assistant
    messages' or the completion's content and end of turn, or the segments labelled true; the default) or all;
    text trains on every token."""

    long_examples: Optional[Literal["split", "drop"]] = None
    """An example longer than seq_len: split over several sequences, or dropped (counted); default: split for
    text (the token stream is cut), drop for messages, prompt-completion and segments."""

    streaming: bool = False
    """Read the rows as they are used instead of into memory (corpora larger than RAM); the packed sequences are
    cached in the oomb cache folder, keyed by the data files' paths, sizes and modification times (not their
    contents, as the datasets library keys its own cache), the tokenizer and these options. A file changed in
    place with its modification time kept (cp -p, rsync -a, touch -r) reads the old sequences: touch the file, or
    delete the cache's packed folder (packed in $OOMB_CACHE_DIR, else in $XDG_CACHE_HOME/oomb, else in
    ~/.cache/oomb)."""

    tokenizer: Optional[str] = None
    """A local Hugging Face tokenizer folder; default: the model folder's own tokenizer where it holds one
    (tokenizer.json, tokenizer_config.json or a SentencePiece tokenizer.model, which needs the sentencepiece
    package), so that the ids are the model's; else (a preset, a folder without one) the bundled 32K SentencePiece
    tokenizer."""

    seq_len: int = 2048
    """Tokens per sequence: the documents are joined into one token stream (EOS between documents) and cut into
    sequences of this length (training: served in a seeded random order; eval: consecutive windows)."""

    document_mask: bool = False
    """Attention and positions stay within each document (documents end at the tokenizer's EOS token); default:
    one causal stream across documents."""

    @_in("data")
    def __post_init__(self) -> None:
        if not check.is_int(self.seq_len) or self.seq_len < 2:
            raise ConfigError("seq_len", f"{{seq_len}} is {literal(self.seq_len)}",
                              "a sequence needs at least 2 tokens (one input, one target); pass {seq_len} 2 or more")
        check.boolean("document_mask", self.document_mask)
        for key in ("split", "text_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass a name, e.g. {{{key}}} {'train' if key == 'split' else 'text'}")
        check.choice("format", self.format, ("auto", "text", "messages", "prompt-completion", "segments"))
        if self.format not in ("auto", "text") and self.text_field != "text":  # the field would be read by nothing
            raise ConfigError("text_field", f"{{text_field}} {literal(self.text_field)} names the field of text rows, "
                              f"but {{format}} is {literal(self.format)}, whose rows do not read it",
                              "leave {text_field} out, or pass {format} text to read that field as plain text")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ConfigError("chat_template", f"{{chat_template}} is {literal(self.chat_template)}", "pass a template file path")
        if self.loss_on is not None:
            check.choice("loss_on", self.loss_on, ("all", "assistant"))
        if self.long_examples is not None:
            check.choice("long_examples", self.long_examples, ("split", "drop"))
        check.boolean("streaming", self.streaming)


@dataclass
class TrainConfig:
    """The optimizer and its schedule."""

    steps: int = 30
    """Optimizer steps (grad_accum sequences each, on every rank)."""

    grad_accum: int = 1
    """Sequences per optimizer step (per rank); the loss is the mean over all their valid tokens."""

    lr: float = 3e-3
    """Peak AdamW learning rate."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    optimizer: Optimizer = "adamw"
    """AdamW (betas 0.9, 0.95) and where its two states per trainable parameter live. adamw: torch's AdamW (fused
    on cuda), states in the parameter dtype on the GPU; adamw8bit: torchao's block-wise 8-bit states (2 bytes
    per parameter); adamw-bf16: torchao's AdamW, bf16 weights updated with stochastic rounding; adamw-cpu: the
    states and the update in host memory, the GPU keeps weights and gradients only."""

    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """After the warm-up: cosine decay to min_lr_factor x lr at the last step, or a constant lr."""

    min_lr_factor: float = 0.1
    """Where the cosine schedule ends, as a fraction of lr (0: at zero; 1: constant after the warm-up)."""

    warmup_steps: Optional[int] = None
    """Linear warm-up steps (both schedules); default: 10% of steps (noted above 10,000). Longer than steps: a
    warning, as the lr then peaks below lr at the last step."""

    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (0: no clipping)."""

    shard: Shard = "none"
    """Under torchrun, what each of the N ranks keeps of the trained model (PyTorch FSDP2 over the decoder layers;
    docs/design.md §8): none: all of it (data parallelism, one gradient all-reduce per step); params: 1/N of the
    weights, gradients and optimizer states, each layer's weights all-gathered for each use (ZeRO-3); grads-optim:
    the weights gathered once per step, the gradients reduce-scattered once per step, 1/N of the optimizer states
    (ZeRO-2). Checkpoints are written with torch.distributed.checkpoint. With --optimizer adamw only. In one
    process it trains as none (a note says so), as accelerate, Lightning and DeepSpeed run a sharding config on
    one device: the same settings serve a one-GPU trial run."""

    @_in("train")
    def __post_init__(self) -> None:
        check.positive_int("steps", self.steps)
        check.positive_int("grad_accum", self.grad_accum)
        check.positive_float("lr", self.lr, "pass a positive learning rate, e.g. {lr} 3e-4")
        check.nonnegative_float("weight_decay", self.weight_decay, "pass 0 or a positive number")
        check.choice("optimizer", self.optimizer, OPTIMIZERS)
        check.choice("lr_schedule", self.lr_schedule, ("cosine", "constant"))
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ConfigError("min_lr_factor", f"{{min_lr_factor}} is {self.min_lr_factor}",
                              "pass a fraction of {lr} from 0 to 1, e.g. {min_lr_factor} 0.1")
        if self.lr_schedule == "constant" and self.min_lr_factor != 0.1:
            raise ConfigError("min_lr_factor", "{min_lr_factor} sets where the cosine schedule ends, but "
                              "{lr_schedule} is constant", "leave {min_lr_factor} out, or pass {lr_schedule} cosine")
        if self.warmup_steps is not None:
            check.nonnegative_int("warmup_steps", self.warmup_steps, "steps")
        check.nonnegative_float("max_grad_norm", self.max_grad_norm, "pass 0 (no clipping) or a positive number")
        check.choice("shard", self.shard, SHARDS)
        if self.shard != "none" and self.optimizer != "adamw":
            why = {"adamw-cpu": "copies whole tensors to the host",
                   "adamw8bit": "quantizes by tensor size, which a shard changes",
                   "adamw-bf16": "is not verified on parameter shards"}[self.optimizer]
            raise ConfigError("shard", f"{{shard}} {self.shard} updates the ranks' parameter shards, which {{optimizer}} "
                              f"{self.optimizer} cannot ({why})",
                              "pass {optimizer} adamw (torch's AdamW: its states are sharded with the parameters), or "
                              "{shard} none")


@dataclass
class OutputConfig:
    """Where a training run writes, and what it prints."""

    dir: Optional[str] = field(default=None, metadata=flag("--output-dir"))
    """Where log.jsonl, checkpoints and the trained model go; must be empty or new unless overwrite."""

    overwrite: bool = False
    """Replace an earlier oomb run in a non-empty output dir: what it wrote (log.jsonl, checkpoints/, the files
    its train_args.json lists) is moved to DIR/.oomb-replaced and deleted once this run saves its model (a
    failed or killed run leaves it there); anything else is kept, and files oomb did not write inside its
    checkpoints/ or tensorboard/ folder are refused, named."""

    save_every: int = 0
    """Write a checkpoint to <output-dir>/checkpoints every N steps (the last 2 are kept); 0: only at the end. A
    checkpoint is also written on SIGINT/SIGTERM once training has started (before it: exit 130, nothing
    written)."""

    resume: Optional[str] = field(default=None, metadata=flag("--resume", metavar="latest|PATH", optional_const="latest"))
    """Continue the run in the output dir from its latest checkpoint ('latest') or from the checkpoint folder
    PATH (a checkpoint of another folder only into a new or empty output dir, that folder left as it is; an
    earlier checkpoint of the output dir only once the later ones are deleted). The model, seq_len, data,
    tokenizer, seed, LoRA settings, grad_accum, dtype, document_mask, RoPE settings, weight_decay, optimizer,
    sparse attention and its options (with it also chunk_size and page_size), the number of ranks and shard must
    be those of the run, and the device for a LoRA run on a random preset (it drew the preset's weights); steps,
    lr, the schedule (and min_lr_factor) and max_grad_norm may change."""

    log_every: int = 1
    """Print a loss line every N steps (log.jsonl gets every step)."""

    progress: Optional[bool] = field(default=None, metadata=flag(
        "--progress", help="Progress bars: --progress shows them, --no-progress hides them; default: shown when "
                           "stderr is a terminal."))
    """Progress bars: shown (true), hidden (false), or None: shown when stderr is a terminal."""

    report_to: Literal["none", "tensorboard"] = "none"
    """Also log every step's loss, lr, grad_norm, tokens_per_s and peak memory (and the held-out loss of --val-every)
    as TensorBoard event files in <output-dir>/tensorboard (offline; point TensorBoard's logdir there). log.jsonl and,
    at the end of the run, loss.png (loss and tokens/s against step) are always written."""

    @_in("output")
    def __post_init__(self) -> None:
        check.boolean("overwrite", self.overwrite)
        check.choice("report_to", self.report_to, ("none", "tensorboard"))
        check.nonnegative_int("save_every", self.save_every, "steps", zero="0 (a checkpoint only at the end)")
        check.positive_int("log_every", self.log_every)
        if self.resume is not None and self.overwrite:
            raise ConfigError("resume", "{resume} continues the run in {dir} but {overwrite} would delete it",
                              "pass one of {resume} and {overwrite}")
        if self.progress is not None:
            check.boolean("progress", self.progress)


@dataclass
class ValidationConfig:
    """Held-out loss during ``oomb train``: which sequences, and how often."""

    every: int = field(default=0, metadata=flag("--val-every", metavar="N"))
    """Evaluate the held-out loss every N optimizer steps and after the last step (a log.jsonl record with
    val_loss, a printed line, a TensorBoard scalar, points on loss.png); 0: never."""

    data: Optional[str] = field(default=None, metadata=flag("--val-data", metavar="PATH"))
    """Held-out data read with the run's data settings (format, fields, chat template, loss_on, long_examples,
    tokenizer, seq_len, document_mask); default: a held-out split of the training data."""

    split: Optional[str] = field(default=None, metadata=flag("--val-split", metavar="NAME"))
    """The split of the held-out data to evaluate; default: validation, else test, whichever the data has; val_data
    with neither: its train split (a single file's one split). Training data with neither (and no val_data) is
    refused before training, as is a split the data lacks."""

    sequences: int = field(default=16, metadata=flag("--val-sequences", metavar="K"))
    """Evaluate at most this many held-out sequences: the first ones in file order, the same at every evaluation.
    Each is built as a training sequence (seq_len tokens, its labels and document bounds); the loss is the mean
    over all their valid targets."""

    @_in("validation")
    def __post_init__(self) -> None:
        check.nonnegative_int("every", self.every, "steps", zero="0 (no held-out loss)")
        check.positive_int("sequences", self.sequences, "sequences")
        for key in ("data", "split"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                example = "validation.jsonl" if key == "data" else "validation"
                raise ConfigError(key, f"{{{key}}} is {literal(value)}", f"pass a {'path' if key == 'data' else 'name'}, "
                                  f"e.g. {{{key}}} {example}, or leave it out")
        if self.every == 0:
            defaults = {f.name: f.default for f in fields(self)}
            for key in ("data", "split", "sequences"):
                if getattr(self, key) != defaults[key]:
                    raise ConfigError(key, f"{{{key}}} sets up the held-out loss but {{every}} is 0 (none is evaluated)",
                                      f"add {{every}} N, or leave {{{key}}} out")


@dataclass
class PlanConfig:
    """``oomb plan``: the machine to plan for and what the step keeps besides the engine."""

    gpu_gib: Optional[float] = None
    """Plan for this much free GPU memory (GiB) instead of this machine's (needed where no CUDA GPU is
    visible)."""

    host_gib: Optional[float] = None
    """Plan for this much available host RAM (GiB) instead of this machine's; the pinned KV host tier may take
    75% of it."""

    no_optimizer: bool = False
    """Leave out the optimizer states (memory of the step alone)."""

    nproc: int = 1
    """Ranks (GPUs) of the run, as torchrun's --nproc_per_node: with shard params or grads-optim the plan counts one
    rank's shard of the weights, gradients and optimizer states and the gathered layers; with shard none every
    rank's whole model. Above 1 it also prints the bytes of one step's collectives."""

    @_in("plan")
    def __post_init__(self) -> None:
        for key in ("gpu_gib", "host_gib"):
            value = getattr(self, key)
            if value is not None and (not check.is_number(value) or not (value > 0 and math.isfinite(value))):
                raise ConfigError(key, f"{{{key}}} is {literal(value)}",
                                  f"pass a positive number of GiB for {{{key}}}, or leave it out to use this machine's")
        check.boolean("no_optimizer", self.no_optimizer)
        check.positive_int("nproc", self.nproc, "ranks")


def _budgets(key: str, budgets) -> None:
    if budgets is None:
        return
    if not isinstance(budgets, (list, tuple)) or not budgets or not all(check.is_int(b) for b in budgets):
        raise ConfigError(key, f"{{{key}}} is {literal(budgets)}", "pass one or more whole numbers of pages")
    for b in budgets:
        if b < 0:
            raise ConfigError(key, f"{{{key}}} has {b}", "pass page budgets of 0 or more")


EvalTask = Literal["loss", "passkey", "needle"]
MAX_NEEDLES = 30
"""The most needle sentences in one needle prompt (one per key word of :data:`oomb.retrieval.prompts.WORDS`)."""


@dataclass
class EvalConfig:
    """``oomb eval``: held-out loss on windows, or retrieval at depth (passkey, needle), dense and per sparse page
    budget."""

    task: EvalTask = "loss"
    """loss: mean loss on consecutive seq_len windows of the data. passkey: a 5-digit pass key hidden at each
    depth of filler text ("The grass is green. ..."), asked for at the end. needle: "The secret <word> is
    <number>." sentences hidden in real text of the data (the bundled novels by default), one of them asked for.
    Retrieval is scored teacher-forced (log-probability of the answer tokens; exact match: every answer token is
    the most likely one), with no generation."""

    num_windows: Optional[int] = None
    """Windows to evaluate (task loss), from the start of the data; default: every whole window, at most 16."""

    lengths: Optional[List[int]] = field(default=None, metadata=flag("--lengths", metavar="T"))
    """Retrieval prompt lengths in tokens (haystack, question and answer; each prompt is exactly this long);
    default: seq_len."""

    depths: Optional[List[float]] = field(default=None, metadata=flag("--depths", metavar="PCT"))
    """Where the answer hides, in percent of the haystack (0: its start, 100: right before the question);
    default: 0 10 20 ... 100."""

    trials: int = 1
    """Retrieval prompts per (length, depth) cell, each with its own seeded position and values."""

    needles: int = 1
    """Needle sentences per needle prompt (task needle, 1 to 30): the first is asked for and sits at the depth, the
    others are distractors at seeded sentence ends."""

    seed: int = field(default=0, metadata=flag("--prompt-seed"))
    """Seed of the retrieval prompts' positions, values and text offsets (the same seed, length, depth and trial
    give the same prompt)."""

    budgets: Optional[List[int]] = field(default=None, metadata=flag("--budgets", metavar="B"))
    """Sparse page budgets to evaluate (pages per query block and KV head, each >= 0, besides the sink and local
    pages); default: dense only. The dense row is always included."""

    json: Optional[str] = field(default=None, metadata=flag("--json", metavar="PATH"))
    """Also write the report (with the per-window losses, or every retrieval trial) as JSON to PATH (new, empty,
    or an earlier 'oomb eval' report of the same task: any other existing file, a report of another task among
    them, is refused)."""

    heatmap: Optional[str] = field(default=None, metadata=flag("--heatmap", metavar="PATH"))
    """Also draw the retrieval results as a PNG heatmap (depth x length, one column per mode: exact-match accuracy
    above, mean answer log-probability below) to PATH (new, or an earlier oomb heatmap: any other existing file, a run's loss.png
    or another program's image among them, is refused)."""

    @_in("eval")
    def __post_init__(self) -> None:
        check.choice("task", self.task, ("loss", "passkey", "needle"))
        if self.num_windows is not None:
            check.positive_int("num_windows", self.num_windows, "windows")
        _budgets("budgets", self.budgets)
        if self.lengths is not None:
            if not isinstance(self.lengths, (list, tuple)) or not self.lengths or not all(check.is_int(t) for t in self.lengths):
                raise ConfigError("lengths", f"{{lengths}} is {literal(self.lengths)}", "pass one or more token counts")
            if min(self.lengths) < 2:
                raise ConfigError("lengths", f"{{lengths}} has {min(self.lengths)}", "pass prompt lengths of 2 tokens or more")
            if len(set(self.lengths)) != len(self.lengths):
                raise ConfigError("lengths", "{lengths} lists a length twice", "name each length once")
        if self.depths is not None:
            if not isinstance(self.depths, (list, tuple)) or not self.depths or not all(check.is_number(d) for d in self.depths):
                raise ConfigError("depths", f"{{depths}} is {literal(self.depths)}", "pass one or more percentages, e.g. {depths} 0 50 100")
            bad = [d for d in self.depths if not (math.isfinite(d) and 0 <= d <= 100)]
            if bad:
                raise ConfigError("depths", f"{{depths}} has {bad[0]:g}, outside [0, 100]",
                                  "pass depths in percent of the haystack, from 0 (its start) to 100 (before the question)")
            if len(set(self.depths)) != len(self.depths):
                raise ConfigError("depths", "{depths} lists a depth twice", "name each depth once")
        check.positive_int("trials", self.trials, "trials")
        if not check.is_int(self.needles) or not 1 <= self.needles <= MAX_NEEDLES:
            raise ConfigError("needles", f"{{needles}} is {literal(self.needles)}", f"pass 1 to {MAX_NEEDLES} needles per prompt")
        if not check.is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError("seed", f"{{seed}} is {literal(self.seed)}", f"pass an integer from 0 to {SEED_LIMIT - 1}")
        if self.heatmap is not None and (not isinstance(self.heatmap, str) or not self.heatmap):
            raise ConfigError("heatmap", f"{{heatmap}} is {literal(self.heatmap)}", "pass a file path, e.g. {heatmap} passkey.png")
        defaults = {f.name: f.default for f in fields(self)}
        if self.task == "loss":
            for key in ("lengths", "depths", "trials", "needles", "seed", "heatmap"):
                if getattr(self, key) != defaults[key]:
                    raise ConfigError(key, f"{{{key}}} sets up a retrieval evaluation but {{task}} is loss",
                                      f"add {{task}} passkey or {{task}} needle, or leave {{{key}}} out")
        else:
            if self.num_windows is not None:
                raise ConfigError("num_windows", f"{{num_windows}} counts loss windows but {{task}} is {self.task}",
                                  "leave {num_windows} out (the retrieval grid is {lengths} x {depths} x {trials})")
            if self.task == "passkey" and self.needles != 1:
                raise ConfigError("needles", "{needles} is for {task} needle; a passkey prompt holds one pass key",
                                  "pass {task} needle, or leave {needles} out")


@dataclass
class GradErrorConfig:
    """``oomb grad-error``: the page budgets measured and how the table is cut."""

    budgets: List[int] = field(default_factory=lambda: [4, 16, 64], metadata=flag("--budgets", metavar="B"))
    """Page budgets to measure."""

    by: Literal["kind", "parameter"] = "kind"
    """Rows of the table: parameter kinds (q_proj, mlp, ...) or every parameter."""

    json: Optional[str] = field(default=None, metadata=flag("--json", metavar="PATH"))
    """Also write the report as JSON to PATH (new, empty, or an earlier 'oomb grad-error' report: any other
    existing file is refused)."""

    @_in("grad_error")
    def __post_init__(self) -> None:
        _budgets("budgets", self.budgets)
        check.choice("by", self.by, ("kind", "parameter"))


@dataclass
class BenchConfig:
    """``oomb bench``: the lengths and systems timed."""

    lengths: List[int] = field(default_factory=lambda: [2048, 4096], metadata=flag("--lengths", metavar="T"))
    """Tokens per sequence, one measurement each."""

    systems: List[Literal["hf", "oomb"]] = field(default_factory=lambda: ["hf", "oomb"])
    """What to time, in this order."""

    steps: int = 2
    """Steps per system and length (oomb on one engine), the last one timed."""

    warmup_len: int = 512
    """Tokens of one untimed warm-up step per system first (0: none)."""

    json: Optional[str] = field(default=None, metadata=flag("--json", metavar="PATH"))
    """Also write the rows and settings as JSON to PATH (new, empty, or an earlier 'oomb bench' report: any
    other existing file is refused)."""

    @_in("bench")
    def __post_init__(self) -> None:
        if not isinstance(self.lengths, (list, tuple)) or not self.lengths or not all(check.is_int(t) for t in self.lengths):
            raise ConfigError("lengths", f"{{lengths}} is {literal(self.lengths)}", "pass one or more token counts")
        for s in self.systems:
            check.choice("systems", s, ("hf", "oomb"))
        check.positive_int("steps", self.steps)
        check.nonnegative_int("warmup_len", self.warmup_len, "tokens", zero="0 (no warm-up)")


@dataclass
class DataReportConfig:
    """``oomb data``: where the length histogram goes and how much of the first sequence is shown."""

    output: Optional[str] = field(default=None, metadata=flag("--output", metavar="PATH"))
    """Write the histogram of example lengths (tokens) as a PNG to PATH (new, or an earlier oomb histogram:
    any other existing file, another picture among them, is refused); default: oomb-data-lengths.png in the current folder."""

    show_tokens: int = 400
    """Print at most this many tokens of the first sequence training reads (0: all of it)."""

    @_in("data_report")
    def __post_init__(self) -> None:
        if self.output is not None and (not isinstance(self.output, str) or not self.output):
            raise ConfigError("output", f"{{output}} is {literal(self.output)}", "pass a file path, e.g. {output} lengths.png")
        check.nonnegative_int("show_tokens", self.show_tokens, "tokens", zero="0 (all of it)")


@dataclass
class DataMakeConfig:
    """``oomb data --make``: a synthetic retrieval training set written as JSON Lines instead of the report."""

    kind: Optional[Literal["passkey", "needle", "keyvalue"]] = field(default=None, metadata=flag("--make"))
    """Write retrieval training rows (read by 'oomb train --data FILE') instead of reporting on the data:
    passkey (a pass key in filler text, asked for at the end) or needle ("The secret <word> is <number>."
    sentences in the --data text, the bundled novels by default, one of them asked for), as prompt/completion
    rows, each as 'oomb eval --task' scores it; or keyvalue (a pass key and needles secret sentences in filler
    text, every one asked for at the end, every answer trained: segments rows, many answers per row). Each row
    at a length of lengths and a random depth, seeded by seed."""

    examples: int = 1000
    """Rows to write."""

    lengths: Optional[List[int]] = field(default=None, metadata=flag("--make-lengths", metavar="T"))
    """Row lengths in tokens of the tokenizer as training encodes a row, its EOS included, so a row fits a
    seq_len of its length (each row takes one at random); default: seq_len."""

    needles: int = 4
    """Needle sentences per needle row (1 to 30; the first is asked for, the others are distractors), or secret
    sentences per keyvalue row (0 to 30; each is asked for, and the pass key: 0 makes passkey rows as segments)."""

    path: Optional[str] = field(default=None, metadata=flag("--make-output", metavar="PATH"))
    """Where the rows go (new, empty, or an earlier 'oomb data --make' file: any other existing file is refused);
    default: oomb-<kind>.jsonl in the current folder."""

    @_in("data_make")
    def __post_init__(self) -> None:
        if self.kind is not None:
            check.choice("kind", self.kind, ("passkey", "needle", "keyvalue"))
        check.positive_int("examples", self.examples, "rows")
        if self.lengths is not None:
            if not isinstance(self.lengths, (list, tuple)) or not self.lengths or not all(check.is_int(t) for t in self.lengths):
                raise ConfigError("lengths", f"{{lengths}} is {literal(self.lengths)}", "pass one or more token counts")
            if min(self.lengths) < 2:
                raise ConfigError("lengths", f"{{lengths}} has {min(self.lengths)}", "pass row lengths of 2 tokens or more")
        least = 0 if self.kind == "keyvalue" else 1
        if not check.is_int(self.needles) or not least <= self.needles <= MAX_NEEDLES:
            raise ConfigError("needles", f"{{needles}} is {literal(self.needles)}", f"pass {least} to {MAX_NEEDLES} needles per row")
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConfigError("path", f"{{path}} is {literal(self.path)}", "pass a file path, e.g. {path} passkey.jsonl")
        if self.kind is None:
            defaults = {f.name: f.default for f in fields(self)}
            for key in ("examples", "lengths", "needles", "path"):
                if getattr(self, key) != defaults[key]:
                    raise ConfigError(key, f"{{{key}}} sets up synthetic rows but {{kind}} is not given",
                                      f"add {{kind}} passkey, needle or keyvalue, or leave {{{key}}} out")
        elif self.kind == "passkey" and self.needles != 4:
            raise ConfigError("needles", "{needles} is for {kind} needle or keyvalue; a passkey row holds one pass key",
                              "pass {kind} needle or keyvalue, or leave {needles} out")


@dataclass
class MergeConfig:
    """``oomb merge``: the LoRA adapter folder to merge into its base model."""

    adapter: Optional[str] = field(default=None, metadata=flag("adapter_dir", metavar="ADAPTER_DIR", positional=True))
    """A LoRA adapter folder: the --output-dir of an 'oomb train --lora-rank' run (its train_args.json says how
    to rebuild the base: the model folder, or the preset with the run's seed, dtype and device), or any peft
    adapter folder whose adapter_config.json names a local base model folder; or an 'oomb train' checkpoint
    folder (or a run folder that stopped before saving its model: its latest checkpoint), whose model is written."""

    @_in("merge")
    def __post_init__(self) -> None:
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter.strip()):
            raise ConfigError("adapter", f"{{adapter}} is {literal(self.adapter)}", "pass the folder of a LoRA adapter")


@dataclass
class JobConfig:
    """Everything one ``oomb`` command runs with; a YAML file holds these sections under the same names."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: OOMBConfig = field(default_factory=OOMBConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    grad_error: GradErrorConfig = field(default_factory=GradErrorConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    data_report: DataReportConfig = field(default_factory=DataReportConfig)
    data_make: DataMakeConfig = field(default_factory=DataMakeConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
