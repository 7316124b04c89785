"""`sparseffn` command line: demo, env."""

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


def build_parser() -> argparse.ArgumentParser:
    from sparseffn.bench.pack_demo import PackDemoConfig

    parser = argparse.ArgumentParser(prog="sparseffn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions, GPU and Triton mode")
    env.set_defaults(func=_cmd_env)
    demo = sub.add_parser("demo", help="pack a realistic synthetic activation into TwELL and verify the sparse MLP")
    _add_dataclass_flags(demo, PackDemoConfig)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
