"""DDP on CPU: two gloo processes train the same model and end with identical weights."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from sparseffn.train.metrics import read_metrics

from .conftest import tiny_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg_dict: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.loop import train

    result = train(TrainConfig.from_dict(cfg_dict), progress=False, echo=None)
    torch.save({k: v.detach().clone() for k, v in result.model.state_dict().items()}, f"{out}/rank{rank}.pt")


@pytest.mark.timeout(300)  # a collective mismatch hangs: fail in minutes, not at the global limit
def test_two_gloo_processes_keep_identical_weights(small_corpus, tmp_path):
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=4, checkpoint_interval=2, eval_interval=2,
                      reinit_dead=True, reinit_dead_after=1, l1_coeff=3e-2)
    mp.spawn(_worker, args=(2, _free_port(), cfg.to_dict(), str(tmp_path)), nprocs=2, join=True)
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    from sparseffn.models import load_pretrained

    saved = load_pretrained(tmp_path / "run" / "model").state_dict()
    assert all(torch.equal(saved[k], a[k]) for k in a)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer (rank 0)
    assert any(r.get("reinit") for r in rows)  # re-init ran, in lockstep on both ranks
    initial = tiny_config(small_corpus, tmp_path / "x")
    from sparseffn.models import build_model

    fresh = build_model(initial.model, initial.sparsity, vocab_size=257, seed=initial.seed,
                        num_hidden_layers=2, max_position_embeddings=32).state_dict()
    assert any(not torch.equal(fresh[k], a[k]) for k in a)  # it trained


def _fsdp_worker(rank: int, world: int, port: int, cfg_dict: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.loop import train

    # One process group for the three runs (train() uses a group it finds and leaves it alone).
    torch.distributed.init_process_group("gloo")
    cfg = TrainConfig.from_dict(cfg_dict)
    train(cfg.replace(out_dir=f"{out}/full"), progress=False, echo=None)
    train(cfg.replace(out_dir=f"{out}/part"), progress=False, echo=None, stop_after_step=3)
    train(cfg.replace(out_dir=f"{out}/part"), resume=True, progress=False, echo=None)
    # both ranks done before the group goes: one full-suite run saw a rank abort in teardown
    # ("terminate called without an active exception"); 14 runs of this test alone passed
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fuse_non_mlp", [False, True], ids=["hf", "fused-norm-rope"])
def test_fsdp_trains_and_resumes_exactly(small_corpus, tmp_path, fuse_non_mlp):
    cfg = tiny_config(small_corpus, tmp_path / "unused", steps=5, checkpoint_interval=2, eval_interval=5,
                      parallel="fsdp", fuse_non_mlp=fuse_non_mlp)
    mp.spawn(_fsdp_worker, args=(2, _free_port(), cfg.to_dict(), str(tmp_path)), nprocs=2, join=True)

    def rows(run):
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")}
                for r in read_metrics(tmp_path / run / "metrics.jsonl")]

    assert [r["step"] for r in rows("full") if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert rows("part") == rows("full")
    from sparseffn.models import load_pretrained

    a = load_pretrained(tmp_path / "full" / "model").state_dict()
    b = load_pretrained(tmp_path / "part" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
