"""`sparseffn` command line: demo, train, eval, generate, pack-demo, fixture, export, bench, env."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import typing
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> list[str]:
    """Versions and accelerator facts a bug report needs."""
    import torch

    lines = [
        f"sparseffn     {_version('sparseffn')}",
        f"python        {platform.python_version()} ({platform.machine()})",
        f"torch         {torch.__version__}",
        f"triton        {_version('triton')}",
        f"transformers  {_version('transformers')}",
        f"numpy         {_version('numpy')}",
    ]
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(f"gpu           {torch.cuda.get_device_name(i)} (compute capability {major}.{minor}, "
                     f"CUDA {torch.version.cuda})")
    else:
        lines.append("gpu           no GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        mode = "interpreted (TRITON_INTERPRET=1: kernels run on CPU tensors, slowly)"
    elif torch.cuda.is_available():
        mode = "native (compiled for the GPU)"
    else:
        mode = "not runnable natively without a GPU (set TRITON_INTERPRET=1 to interpret kernels on CPU)"
    lines.append(f"triton mode   {mode}")
    return lines


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.default is None:  # an optional field: its type from the annotation, None spelled `none`
            base = next(t for t in typing.get_args(hints[field.name]) if t is not type(None))
            if base is bool:
                parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                                    help="(default: not given)")
            else:
                parser.add_argument(flag, dest=field.name, default=None, help="(default: none)",
                                    type=lambda text, base=base: None if text.lower() == "none" else base(text))
        elif isinstance(field.default, bool):
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default,
                                help=f"(default: {field.default})")
        else:
            parser.add_argument(flag, dest=field.name, type=type(field.default), default=field.default,
                                help=f"(default: {field.default})")


def _cmd_env(_: argparse.Namespace) -> int:
    print("\n".join(env_report()))
    return 0


def _cmd_pack_demo(args: argparse.Namespace) -> int:
    from sparseffn.bench.pack_demo import PackDemoConfig, run_pack_demo

    cfg = PackDemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PackDemoConfig)})
    result = run_pack_demo(cfg)
    print("\n".join(result.lines))
    return 0 if result.ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.synthetic:
        from sparseffn.bench.pack_demo import PackDemoConfig, run_pack_demo

        result = run_pack_demo(PackDemoConfig())
        print("\n".join(result.lines))
        return 0 if result.ok else 1
    from sparseffn.train.config import config_from_flags
    from sparseffn.train.demo import DEMO_CONFIG, run_demo

    cfg = config_from_flags(args, DEMO_CONFIG)
    result = run_demo(cfg, progress=args.progress, generate_tokens=args.generate_tokens)
    return 0 if result.ok else 1


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparseffn.train.config import TrainConfig, config_from_flags
    from sparseffn.train.loop import train

    if args.resume:
        folder = Path(args.resume)
        base = TrainConfig.load(folder)
        if args.config is not None:
            raise ValueError("--config and --resume exclude each other (a resumed run uses its own config.json)")
        cfg = config_from_flags(args, base.replace(out_dir=str(folder)))
        if cfg.out_dir != str(folder):
            raise ValueError(f"--out-dir {cfg.out_dir} differs from the run being resumed ({folder})")
    else:
        from sparseffn.train.relufy import PRESETS

        if args.config is not None and args.preset is not None:
            raise ValueError("--config and --preset exclude each other (both give the starting config)")
        base = TrainConfig.load(args.config) if args.config is not None else PRESETS[args.preset or "pretrain"]
        cfg = config_from_flags(args, base)
    result = train(cfg, resume=bool(args.resume), overwrite=args.overwrite, progress=args.progress)
    if result.final_eval is not None:
        stats = result.final_eval.stats  # None for a dense run
        print(f"held-out CE {result.final_eval.ce:.4f} (perplexity {result.final_eval.ppl:.2f}), "
              f"{f'{stats.zeros_pct:.2f}% zeros' if stats is not None else 'dense'}; run in {result.out_dir}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from sparseffn.train.eval import run_eval

    for flag, value in (("--seq-len", args.seq_len), ("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must lie in (0, 1), got {args.eval_fraction}")
    _, lines, _ = run_eval(args.ckpt, data=args.data, eval_fraction=args.eval_fraction, seq_len=args.seq_len,
                           batches=args.batches, batch_size=args.batch_size, device=_device_flag(args.device).type,
                           out_dir=args.out_dir)
    print("\n".join(lines))
    return 0


def _device_flag(name: str):
    """The torch.device of a --device flag (auto, cpu or cuda), checked."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (use --device auto or cpu)")
    return torch.device(name)


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from sparseffn.models.generate import CapturedDecoder
    from sparseffn.train.eval import load_for_eval, resolve_target

    # every flag is checked before the model loads, so errors name the flag typed
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.temperature == 0 and (args.top_k != 0 or args.top_p != 1.0):
        raise ValueError("--top-k and --top-p filter sampled tokens: give --temperature > 0 too")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: all tokens), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1: all tokens), got {args.top_p}")
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text to continue")
    if args.engine == "fused" and args.compile:
        raise ValueError("--engine fused replaces the forward that --compile compiles: pick one")
    device = _device_flag(args.device)
    model, tokenizer, _ = load_for_eval(resolve_target(args.run), device)
    if device.type == "cuda":
        model.to(torch.bfloat16)
    ids = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    if ids.shape[1] == 0:
        raise ValueError("--prompt: the tokenizer made no tokens of it; give some text")
    # a CUDA graph per decode step on a GPU (--no-captured, or a CPU: every step eagerly, same tokens)
    eager_steps = 5 if args.captured else args.max_new_tokens
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) \
        if args.temperature > 0 else {}
    torch.manual_seed(args.seed)
    decoder = CapturedDecoder(model, batch_size=1, max_length=ids.shape[1] + args.max_new_tokens,
                              eager_steps=eager_steps, compile=args.compile, engine=args.engine, **sampling)
    out = decoder.generate(ids, args.max_new_tokens)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def _cmd_fixture(args: argparse.Namespace) -> int:
    import torch

    from sparseffn.models.reference_fixture import FixtureSpec, write_fixture

    given = {name: getattr(args, name) for name in ("base", "gated", "bias", "new_intermediate_size", "dtype", "seed",
                                                    "gate_shift", "tokenizer", "vocab_size", "num_hidden_layers")
             if getattr(args, name) is not None}
    if args.shard_mb is not None:
        if args.shard_mb <= 0:
            raise ValueError(f"--shard-mb must be > 0, got {args.shard_mb}")
        given["max_shard_bytes"] = int(args.shard_mb * 2**20)
    spec = FixtureSpec(**given) if args.shape == "tiny" else FixtureSpec.paper(args.shape, **given)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = write_fixture(args.out_dir, spec, device=device)
    print(f"wrote a {spec.base}_sparse_relu checkpoint ({'gated' if spec.gated else 'non-gated'}, H={spec.mlp_size}, "
          f"{spec.num_hidden_layers} layers, {spec.dtype}, random weights) to {folder}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparseffn.models import load_pretrained
    from sparseffn.models.reference import copy_tokenizer_files, export_reference

    out = Path(args.out_dir)
    if (out / "config.json").exists():
        raise FileExistsError(f"OUT_DIR {out} already holds a config.json: give an empty or new directory")
    if args.shard_mb is not None and args.shard_mb <= 0:
        raise ValueError(f"--shard-mb must be > 0, got {args.shard_mb}")
    model = load_pretrained(args.model)
    export_reference(model, out, max_shard_size=None if args.shard_mb is None else int(args.shard_mb * 2**20))
    copied = copy_tokenizer_files(args.model, out) if Path(args.model).is_dir() else []
    print(f"wrote {args.model} in the reference format ({model.config.model_type}_sparse_relu) to {out}"
          + (f" with its tokenizer files ({', '.join(copied)})" if copied else " (no tokenizer files to copy)"))
    return 0


def _cmd_bench_mlp(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparseffn.bench.mlp import MLPBenchConfig, run_mlp_bench
    from sparseffn.bench.mlp_train import TrainBenchConfig, run_train_bench
    from sparseffn.bench.report import mlp_table, plot_mlp, plot_train, train_table
    from sparseffn.bench.timing import device_slug

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.train:
        # The flags are `bench mlp`'s; those left at their inference defaults take the training defaults.
        defaults = MLPBenchConfig()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainBenchConfig)
                 if getattr(args, f.name) != getattr(defaults, f.name)}
        cfg = TrainBenchConfig(**given)
        rows = run_train_bench(cfg, device)
        folder = Path(cfg.out_dir) / device_slug(device)
        plot_train(rows, folder / "mlp_train.png")
        print(train_table(rows))
        print(f"wrote {folder / 'mlp_train.csv'} and {folder / 'mlp_train.png'}")
        return 0
    cfg = MLPBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MLPBenchConfig)})
    rows = run_mlp_bench(cfg, device)
    folder = Path(cfg.out_dir) / device_slug(device)
    plot_mlp(rows, folder / "mlp.png")
    print(mlp_table(rows))
    print(f"wrote {folder / 'mlp.csv'} and {folder / 'mlp.png'}")
    return 0


def _run_bench(args: argparse.Namespace, config_cls: type, run, table, plot, name: str) -> int:
    """Build config_cls from the parsed flags, run on the best device, write NAME.png, print the table."""
    from pathlib import Path

    from sparseffn.bench.timing import device_slug

    import torch

    cfg = config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = run(cfg, device)
    folder = Path(cfg.out_dir) / device_slug(device)
    plot(rows, folder / f"{name}.png")
    print(table(rows))
    print(f"wrote {folder / f'{name}.csv'} and {folder / f'{name}.png'}")
    return 0


def _cmd_bench_e2e(args: argparse.Namespace) -> int:
    from sparseffn.bench.e2e import E2EBenchConfig, run_e2e_bench
    from sparseffn.bench.report import e2e_table, plot_e2e

    return _run_bench(args, E2EBenchConfig, run_e2e_bench, e2e_table, plot_e2e, "e2e")


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    from sparseffn.bench.decode import DecodeBenchConfig, decode_table, plot_decode, run_decode_bench

    return _run_bench(args, DecodeBenchConfig, run_decode_bench, decode_table, plot_decode, "decode_mlp")


def _cmd_bench_decode_model(args: argparse.Namespace) -> int:
    from sparseffn.bench.decode_model import (DecodeModelBenchConfig, decode_model_table, plot_decode_model,
                                              run_decode_model_bench)

    return _run_bench(args, DecodeModelBenchConfig, run_decode_model_bench, decode_model_table, plot_decode_model,
                      "decode_model")


def _cmd_bench_train_run(args: argparse.Namespace) -> int:
    from sparseffn.bench.train_run import TrainRunBenchConfig, plot_train_run, run_train_run_bench, train_run_table

    def table(rows: list[dict]) -> str:
        return train_run_table(rows, args.table_window, args.sparse_share)

    return _run_bench(args, TrainRunBenchConfig, run_train_run_bench, table, plot_train_run, "train_run")


def _cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from sparseffn.bench.calibrate import CalibrateBenchConfig, calibrate_table, plot_calibrate, run_calibrate_bench

    return _run_bench(args, CalibrateBenchConfig, run_calibrate_bench, calibrate_table, plot_calibrate, "calibrate")


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    """Relufy a dense model and fine-tune it; rewrite OUT_DIR/relufy.csv and .png from every run under OUT_DIR/runs."""
    import importlib.util
    from pathlib import Path

    from sparseffn.bench.quality import plot_relufy, relufy_rows, relufy_table, write_relufy_csv
    from sparseffn.bench.timing import git_sha
    from sparseffn.train.config import config_from_flags
    from sparseffn.train.relufy import RECORD, RELUFY_CONFIG, relufy_quality

    cfg = config_from_flags(args, RELUFY_CONFIG.replace(out_dir="runs/relufy_quality"))
    if cfg.init_from is None:
        raise ValueError("bench quality needs --init-from DIR (a dense model directory or a `sparseffn train --dense` "
                         "run); L1 sweeps of runs trained from scratch: benchmarks/quality_sweep.sh")
    # relufy_quality loads and relufies the dense model itself and hands it to the loop as its initial model
    init_from, cfg = cfg.init_from, cfg.replace(init_from=None)
    name = args.name or (f"l1_{cfg.sparsity.l1_coeff:g}_{cfg.sparsity.l1_schedule}"
                         + (f"_kd{cfg.distill_weight:g}" if cfg.distill_weight > 0 else ""))
    relufy_quality(init_from, cfg, name, progress=args.progress)
    root = Path(cfg.out_dir)
    runs = sorted(d for d in (root / "runs").iterdir() if (d / RECORD).is_file())
    sha = git_sha()
    rows = [row for run in runs for row in relufy_rows(run, sha)]
    written = [write_relufy_csv(rows, root / "relufy.csv")]
    if importlib.util.find_spec("matplotlib") is not None:
        written.append(plot_relufy(rows, root / "relufy.png"))
    else:
        print("note: matplotlib is not installed, so no relufy.png (pip install 'sparseffn[plot]'; "
              "sparseffn.bench.quality.plot_relufy draws it from the CSV's rows)")
    print(relufy_table(rows))
    print(f"wrote {' and '.join(map(str, written))} ({len(runs)} run(s) under {root / 'runs'})")
    return 0


def _cmd_bench_report(args: argparse.Namespace) -> int:
    """Every generated table of the README and the docs pages whose CSV exists, with its PNG."""
    from pathlib import Path

    from sparseffn.bench.report import pages_with_blocks, regenerate

    readme = Path(args.readme)
    docs = [Path(d) for d in args.docs] if args.docs else pages_with_blocks(readme.parent / "docs")
    files = [readme] + docs
    used = regenerate(args.results_dir, files, plots=args.plots)
    print(f"updated {', '.join(map(str, files))}{' and the PNGs' if args.plots else ''} from {', '.join(used)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from sparseffn.bench.calibrate import CalibrateBenchConfig
    from sparseffn.bench.decode import DecodeBenchConfig
    from sparseffn.bench.decode_model import DecodeModelBenchConfig
    from sparseffn.bench.train_run import TrainRunBenchConfig
    from sparseffn.bench.e2e import E2EBenchConfig
    from sparseffn.bench.mlp import MLPBenchConfig
    from sparseffn.bench.pack_demo import PackDemoConfig
    from sparseffn.train.config import TrainConfig, add_config_flags
    from sparseffn.train.demo import DEMO_CONFIG
    from sparseffn.train.relufy import RELUFY_CONFIG

    parser = argparse.ArgumentParser(prog="sparseffn", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error, user errors too")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions, GPU and Triton mode")
    env.set_defaults(func=_cmd_env)

    demo = sub.add_parser(
        "demo", help="train the tiny model with L1 on the embedded corpus, show its sparsity, pack its real "
        "activations into TwELL, generate text (a few minutes on a CPU)",
        description="Every training flag works here too, with the demo's defaults (shown).")
    demo.add_argument("--synthetic", action="store_true",
                      help="run the synthetic TwELL packing demo instead (`sparseffn pack-demo` takes its flags)")
    demo.add_argument("--generate-tokens", type=int, default=48, help="tokens generated per sample (default: 48)")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    add_config_flags(demo, TrainConfig, defaults=DEMO_CONFIG)
    demo.set_defaults(func=_cmd_demo)

    pack = sub.add_parser("pack-demo",
                          help="pack a realistic synthetic activation into TwELL and verify the sparse MLP")
    _add_dataclass_flags(pack, PackDemoConfig)
    pack.set_defaults(func=_cmd_pack_demo)

    tr = sub.add_parser("train", help="train a sparse model (ReLU + L1); under torchrun: DDP or FSDP",
                        description="Flags map onto TrainConfig and SparsityConfig fields; the resolved config is "
                        "saved as OUT_DIR/config.json.")
    tr.add_argument("--config", default=None, help="start from this config.json instead of the defaults")
    tr.add_argument("--resume", default=None, metavar="RUN_DIR",
                    help="continue the run in RUN_DIR from its newest checkpoint (exactly as if never stopped)")
    tr.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out-dir (at the new run's first checkpoint; a run that fails "
                         "before it leaves the earlier one untouched)")
    tr.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    tr.add_argument("--preset", choices=("pretrain", "relufy"), default=None,
                    help="start from a preset instead of the defaults: pretrain (the defaults shown) or relufy "
                         "(fine-tuning a relufied pretrained model: docs/sparsify.md)")
    add_config_flags(tr, TrainConfig, defaults=TrainConfig())
    tr.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval", help="held-out perplexity and per-layer sparsity of a trained model (table + PNG)")
    ev.add_argument("ckpt", metavar="CKPT", help="a run directory, its model/ folder, a checkpoints/step_*.pt file or "
                                                 "a model directory with its tokenizer.json (e.g. a SparseLM checkpoint)")
    ev.add_argument("--data", default=None, help="text file or directory (default: the run's data)")
    ev.add_argument("--eval-fraction", type=float, default=None,
                    help="held-out tail of each document (default: the run's)")
    ev.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the run's)")
    ev.add_argument("--batches", type=int, default=None, help="batches of windows (default: the run's eval_batches)")
    ev.add_argument("--batch-size", type=int, default=None, help="windows per batch (default: the run's)")
    ev.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="(default: auto)")
    ev.add_argument("--out-dir", default=None, help="where eval.json and eval_layers.png go (default: RUN/eval)")
    ev.set_defaults(func=_cmd_eval)

    gen = sub.add_parser("generate", help="greedy text from a trained run (a CUDA graph per decode step on a GPU)")
    gen.add_argument("run", metavar="RUN_DIR", help="a run directory, its model/ folder, a checkpoints/step_*.pt file "
                                                    "or a model directory with its tokenizer.json (e.g. a SparseLM checkpoint)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="(default: auto)")
    gen.add_argument("--captured", action=argparse.BooleanOptionalAction, default=True,
                     help="replay each decode step from a CUDA graph on a GPU (default: on)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy (default); above 0: sample from softmax(logits / temperature)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample among the fewest most likely tokens whose probabilities reach p (1: all)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                     help="also run the decode step's forward through torch.compile: a slower start (the "
                          "compile), faster steps; for long generations (default: off)")
    gen.add_argument("--engine", default="auto", choices=("auto", "hf", "fused"),
                     help="the decode step: the Hugging Face forward (hf), the fused decode engine of Llama-family "
                          "models (fused), or fused where it was measured faster: a Hopper GPU, compile off (auto, "
                          "the default)")
    gen.set_defaults(func=_cmd_generate)

    fx = sub.add_parser("fixture", help="write a checkpoint in the format of the paper's released SparseLM models "
                                        "(the reference code's *_sparse_relu), at random weights, for offline tests",
                        description="Random weights with a few percent of the ReLU units firing per token (measure "
                        "the activity: it is not calibrated). Unset flags keep the shape's values.")
    fx.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory to write")
    fx.add_argument("--shape", default="tiny", choices=("tiny", "0.5b", "1b", "1.5b", "2b"),
                    help="tiny (CPU tests) or a released SparseLM model's shape (default: tiny)")
    fx.add_argument("--base", default=None, choices=("llama", "qwen2"), help="base architecture (default: llama)")
    fx.add_argument("--gated", action=argparse.BooleanOptionalAction, default=None,
                    help="gated MLPs (relu(gate) * up) or not (relu(up)) (default: gated)")
    fx.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None, help="MLP biases (mlp_bias)")
    fx.add_argument("--new-intermediate-size", type=int, default=None,
                    help="the MLPs' width when resized (sparsity_new_intermediate_size)")
    fx.add_argument("--num-hidden-layers", type=int, default=None, help="decoder layers (default: the shape's)")
    fx.add_argument("--vocab-size", type=int, default=None, help="vocabulary (default: the shape's)")
    fx.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"), help="(default: bfloat16)")
    fx.add_argument("--shard-mb", type=float, default=None, help="shard the weights at this many MiB per file")
    fx.add_argument("--seed", type=int, default=None, help="(default: 0)")
    fx.add_argument("--gate-shift", type=float, default=None,
                    help="gate pre-activations centred this many standard deviations below zero (default: 2.5; "
                         "0: plain random weights, half the units firing)")
    fx.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=None,
                    help="also write a byte-level tokenizer (default: on)")
    fx.add_argument("--device", default="auto", help="where the random weights are drawn: auto, cpu or cuda")
    fx.set_defaults(func=_cmd_fixture)

    ex = sub.add_parser("export", help="write a sparse model in the reference code's format (*_sparse_relu) for use "
                                       "with the paper's code")
    ex.add_argument("model", metavar="MODEL", help="a model directory load_pretrained opens (or a Hub id)")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory to write")
    ex.add_argument("--shard-mb", type=float, default=None, help="shard the weights at this many MiB per file")
    ex.set_defaults(func=_cmd_export)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    mlp = bench.add_parser("mlp", help="sparse MLP inference (or, with --train, a training step) vs dense torch "
                                       "(CSV + PNG under --out-dir)")
    _add_dataclass_flags(mlp, MLPBenchConfig)
    mlp.add_argument("--train", action="store_true",
                     help="forward + backward with the L1 penalty, with peak memory (defaults: tokens 4096,16384,65536; "
                          "providers dense,dense_compiled,sparse,auto and, on CUDA, dense_graph,sparse_graph)")
    mlp.set_defaults(func=_cmd_bench_mlp)
    e2e = bench.add_parser("e2e", help="whole model, dense vs sparse MLPs: prefill and training throughput, memory, "
                                       "energy (CSV + PNG under --out-dir)")
    _add_dataclass_flags(e2e, E2EBenchConfig)
    e2e.set_defaults(func=_cmd_bench_e2e)
    dec = bench.add_parser("decode", help="few-token MLP calls (decode): dense torch vs the decode kernels, eager "
                                          "and CUDA-graphed, cold and warm L2 (CSV + PNG under --out-dir)")
    _add_dataclass_flags(dec, DecodeBenchConfig)
    dec.set_defaults(func=_cmd_bench_decode)
    dm = bench.add_parser("decode-model", help="whole-model generation, dense vs sparse MLPs: Hugging Face eager "
                                               "generate and a CUDA-graph decode step (CSV + PNG under --out-dir)")
    _add_dataclass_flags(dm, DecodeModelBenchConfig)
    dm.set_defaults(func=_cmd_bench_decode_model)
    run = bench.add_parser("train-run", help="training runs from initialization at the paper's sparsity, auto vs "
                                             "dense mode vs λ = 0, each in its own process: tokens/s, activity, "
                                             "layers sparse and held-out CE per window (CSV + PNG under --out-dir)")
    _add_dataclass_flags(run, TrainRunBenchConfig)
    run.set_defaults(func=_cmd_bench_train_run)
    cal = bench.add_parser("calibrate", help="post-training thresholds on a trained run: held-out CE and sparsity "
                                             "per target nnz (CSV + PNG under --out-dir)")
    cal.add_argument("checkpoint", metavar="RUN_DIR", help="a training run directory (config.json, model/), or a model "
                     "directory with its tokenizer.json (a released checkpoint)")
    _add_dataclass_flags(cal, CalibrateBenchConfig, skip=("checkpoint",))
    cal.set_defaults(func=_cmd_bench_calibrate)
    quality = bench.add_parser(
        "quality", help="relufy a dense model and fine-tune it with L1: its held-out CE, then zeros, active units "
                        "and CE along the run (OUT_DIR/relufy.csv + relufy.png over every run in OUT_DIR/runs)",
        description="Training flags map onto TrainConfig as for `sparseffn train`; defaults: the relufy preset "
                    "(shown), out-dir runs/relufy_quality. Each call adds (or replaces) the run --name.")
    quality.add_argument("--name", default=None,
                         help="the run's folder under OUT_DIR/runs (default: from λ, the schedule and distillation)")
    quality.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    add_config_flags(quality, TrainConfig, defaults=RELUFY_CONFIG)
    quality.set_defaults(func=_cmd_bench_quality)
    report = bench.add_parser("report", help="regenerate the tables of the README and the docs pages, and the "
                                             "PNGs, from the benchmark CSVs")
    report.add_argument("--results-dir", default="benchmarks/results",
                        help="the results root (device folders below it) or one device folder")
    report.add_argument("--readme", default="README.md")
    report.add_argument("--docs", action="append", default=None,
                        help="a docs page with generated tables, repeatable (default: every docs/*.md beside the "
                             "README holding a <!-- bench:NAME --> block)")
    report.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="redraw the PNGs")
    report.set_defaults(func=_cmd_bench_report)
    return parser


# Errors a user can act on (a bad flag value or config, a missing or busy run, no usable checkpoint, a
# full disk, a diverged run) by the library's convention; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, NotImplementedError, OSError, FloatingPointError)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error prints one line on stderr and returns 2 (`--debug`: raises it)."""
    args = build_parser().parse_args(argv)
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"sparseffn {args.command}: error: {message} (sparseffn --debug {args.command} ... shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
