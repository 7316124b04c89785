"""The environment of a child Python process that must import this very sparseffn: its source folder
goes first on PYTHONPATH (a source tree imported without installing, or another installed copy, would
otherwise leave the child without it or with the other one)."""

from __future__ import annotations

import os
from pathlib import Path


def child_env() -> dict[str, str]:
    """os.environ with this sparseffn's parent folder first on PYTHONPATH."""
    env = dict(os.environ)
    source = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env
