"""Training pipeline: config, data and tokenizer, the loop (L1 schedule, sparsity tracking, dead-unit
re-init, checkpoints, DDP/FSDP), evaluation, plots and the `sparseffn demo` job.

Only `sparseffn.cli` imports this package; transformers / tokenizers / matplotlib load on first use.
"""

from sparseffn.train.config import TrainConfig

__all__ = ["TrainConfig"]
