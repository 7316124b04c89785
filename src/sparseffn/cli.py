"""`sparseffn` command line: demo, bench, env."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
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


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, dest=field.name, type=type(field.default), default=field.default,
                            help=f"(default: {field.default})")


def _cmd_env(_: argparse.Namespace) -> int:
    print("\n".join(env_report()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from sparseffn.bench.pack_demo import PackDemoConfig, run_pack_demo

    cfg = PackDemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PackDemoConfig)})
    result = run_pack_demo(cfg)
    print("\n".join(result.lines))
    return 0 if result.ok else 1


def _cmd_bench_mlp(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparseffn.bench.mlp import MLPBenchConfig, run_mlp_bench
    from sparseffn.bench.report import mlp_table, plot_mlp
    from sparseffn.bench.timing import device_slug

    import torch

    cfg = MLPBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MLPBenchConfig)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = run_mlp_bench(cfg, device)
    folder = Path(cfg.out_dir) / device_slug(device)
    plot_mlp(rows, folder / "mlp.png")
    print(mlp_table(rows))
    print(f"wrote {folder / 'mlp.csv'} and {folder / 'mlp.png'}")
    return 0


def _cmd_bench_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparseffn.bench.report import mlp_table, plot_mlp, read_rows, replace_block

    csv_path = Path(args.csv)
    rows = read_rows(csv_path)
    plot_mlp(rows, csv_path.with_suffix(".png"))
    readme = Path(args.readme)
    readme.write_text(replace_block(readme.read_text(), "mlp", mlp_table(rows)))
    print(f"updated {readme} and {csv_path.with_suffix('.png')} from {csv_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from sparseffn.bench.mlp import MLPBenchConfig
    from sparseffn.bench.pack_demo import PackDemoConfig

    parser = argparse.ArgumentParser(prog="sparseffn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions, GPU and Triton mode")
    env.set_defaults(func=_cmd_env)
    demo = sub.add_parser("demo", help="pack a realistic synthetic activation into TwELL and verify the sparse MLP")
    _add_dataclass_flags(demo, PackDemoConfig)
    demo.set_defaults(func=_cmd_demo)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    mlp = bench.add_parser("mlp", help="sparse MLP inference vs dense torch (CSV + PNG under --out-dir)")
    _add_dataclass_flags(mlp, MLPBenchConfig)
    mlp.set_defaults(func=_cmd_bench_mlp)
    report = bench.add_parser("report", help="regenerate the README table and PNG from a benchmark CSV")
    report.add_argument("--csv", default="benchmarks/results/h200/mlp.csv")
    report.add_argument("--readme", default="README.md")
    report.set_defaults(func=_cmd_bench_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
