"""The attention side of a decode step at the 2b shape (H200 probe, bench only): per batch, each call
of ops.decode_attention graph-replayed with L2 flushed (as `bench decode` times), against its torch
equivalent in the same CUDA graph setting, with the bytes each must move and the bandwidth reached;
then (unless --no-sweep) a small sweep of the kernels' launch configs.

    python benchmarks/probes/decode_attention.py OUT_DIR [--no-sweep]

2b: D 2048, 32 query and 32 key/value heads of 64, bf16, a 4096-slot cache, positions ~600.
torch equivalents: q/k/v as Hugging Face computes them but with one fused [3D, D] projection (the
best eager torch), RoPE, and the cache rows written by index; attention as a static-cache decoder
does it (SDPA over the whole cache with a mask, what a CUDA graph can replay at any position) and,
for reference, SDPA over the first ~600 slots only (shapes fixed at capture); o_proj + residual.
Writes OUT_DIR/decode_attention.csv and OUT_DIR/decode_attention_sweep.csv; prints a table.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseffn.bench.common import rel_err, write_csv
from sparseffn.bench.timing import cuda_graphed, run_metadata, time_fn
from sparseffn.kernels.configs.decode_attention import AttentionConfig, ProjectionConfig, projection_config
from sparseffn.kernels.decode_attention import launch_decode_attention
from sparseffn.kernels.decode_attn_proj import launch_decode_out_proj, launch_decode_qkv_rope
from sparseffn.kernels.decode_mlp import m_pad
from sparseffn.ops.decode_attention import decode_attention, decode_out_proj, decode_qkv_rope

D, HQ, HKV, HEAD, S_MAX, POSITION = 2048, 32, 32, 64, 4096, 600
BATCHES = (1, 4, 16)
HBM_TB_S = 3.5  # the bandwidth the targets are stated at (H200 stream reads)
FIELDS = ("gpu", "torch", "triton", "git_sha", "batch", "op", "provider", "us", "p20_us", "p80_us", "bytes", "gb_s",
          "roofline_us", "rel_err")


def problem(b, dev):
    g = torch.Generator(device=dev).manual_seed(b)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).bfloat16()

    inv = 1.0 / 1e5 ** (torch.arange(0, HEAD, 2, device=dev).float() / HEAD)
    emb = torch.outer(torch.arange(S_MAX, device=dev).float(), inv).repeat(1, 2)
    p = dict(hidden=rnd(b, D), norm_weight=(torch.rand(D, generator=g, device=dev) + 0.5).bfloat16(), eps=1e-5,
             wq=rnd(HQ * HEAD, D, scale=D**-0.5), wk=rnd(HKV * HEAD, D, scale=D**-0.5),
             wv=rnd(HKV * HEAD, D, scale=D**-0.5), bq=None, bk=None, bv=None, cos_table=emb.cos(),
             sin_table=emb.sin(), positions=POSITION + torch.arange(b, device=dev) % 8,
             k_cache=rnd(b, HKV, S_MAX, HEAD), v_cache=rnd(b, HKV, S_MAX, HEAD))
    p["w_qkv"] = torch.cat((p["wq"], p["wk"], p["wv"]))
    p["wo"] = rnd(D, HQ * HEAD, scale=(HQ * HEAD) ** -0.5)
    p["q"] = rnd(b, HQ, HEAD)
    p["attn"] = rnd(b, HQ * HEAD)
    p["counters"] = torch.zeros(b * HKV, dtype=torch.int32, device=dev)
    return p


QKV_ARGS = ("hidden", "norm_weight", "eps", "wq", "wk", "wv", "bq", "bk", "bv", "cos_table", "sin_table", "positions",
            "k_cache", "v_cache")


def torch_qkv(p):
    x = p["hidden"]
    xf = x.float()
    n = p["norm_weight"] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + p["eps"])).to(x.dtype)
    b = x.shape[0]
    q, k, v = F.linear(n, p["w_qkv"]).view(b, -1, HEAD).split((HQ, HKV, HKV), dim=1)
    cos = p["cos_table"][p["positions"]].to(x.dtype)[:, None]
    sin = p["sin_table"][p["positions"]].to(x.dtype)[:, None]

    def rope(t):
        return t * cos + torch.cat((-t[..., HEAD // 2:], t[..., :HEAD // 2]), -1) * sin

    rows = torch.arange(b, device=x.device)
    p["k_cache"][rows, :, p["positions"]] = rope(k)
    p["v_cache"][rows, :, p["positions"]] = v
    return rope(q)


def torch_attention(p, length=None):
    """SDPA over the cache's first `length` slots (None: all of them), masked past each position."""
    k, v = p["k_cache"], p["v_cache"]
    if length is not None:
        k, v = k[:, :, :length], v[:, :, :length]
    slots = torch.arange(k.shape[2], device=k.device)
    mask = (slots[None, :] <= p["positions"][:, None])[:, None, None, :]  # [B, 1, 1, S]
    o = F.scaled_dot_product_attention(p["q"][:, :, None], k, v, attn_mask=mask, scale=HEAD**-0.5)
    return o.reshape(o.shape[0], -1)


def timed(fn, dev, rep_ms):
    graphed = cuda_graphed(fn, dev)
    t = min((time_fn(graphed, dev, rep_ms=rep_ms) for _ in range(3)), key=lambda t: t.median_ms)
    return t


def measure(b, dev, meta):
    p = problem(b, dev)
    rows = []
    valid = int((p["positions"] + 1).sum()) * HKV * HEAD * 2 * 2  # k and v rows attention must read
    kinds = {
        "qkv_rope": (3 * D * D * 2 + 2 * b * HKV * HEAD * 2,
                     [("ours", lambda: decode_qkv_rope(*(p[n] for n in QKV_ARGS))), ("torch", lambda: torch_qkv(p))]),
        "attention": (valid, [
            ("ours", lambda: decode_attention(p["q"], p["k_cache"], p["v_cache"], p["positions"], HEAD**-0.5,
                                              counters=p["counters"])),
            ("ours_fresh_counters", lambda: decode_attention(p["q"], p["k_cache"], p["v_cache"], p["positions"],
                                                             HEAD**-0.5)),
            ("torch_full_cache", lambda: torch_attention(p)),
            ("torch_sliced", lambda: torch_attention(p, POSITION + 8))]),
        "out_proj": (D * HQ * HEAD * 2, [("ours", lambda: decode_out_proj(p["attn"], p["wo"], None, p["hidden"])),
                                         ("torch", lambda: p["hidden"] + F.linear(p["attn"], p["wo"]))]),
    }
    for op, (nbytes, providers) in kinds.items():
        outs = {}
        for provider, fn in providers:
            outs[provider] = fn().clone()  # before the graph's replays (q/k/v writes the cache each time)
            t = timed(fn, dev, rep_ms=40)
            rows.append(dict(meta, batch=b, op=op, provider=provider, us=round(t.median_ms * 1e3, 2),
                             p20_us=round(t.p20_ms * 1e3, 2), p80_us=round(t.p80_ms * 1e3, 2), bytes=nbytes,
                             gb_s=round(nbytes / (t.median_ms * 1e6), 1),
                             roofline_us=round(nbytes / (HBM_TB_S * 1e6), 2), rel_err=""))
        reference = next(out for provider, out in outs.items() if provider.startswith("torch"))
        for row in rows:  # each of ours against the first torch equivalent, same inputs
            if row["op"] == op and row["provider"].startswith("ours"):
                row["rel_err"] = f"{rel_err(outs[row['provider']], reference):.1e}"
    return rows


def sweep(b, dev, meta):
    """Launch configs of the three kernels at batch b (µs, graph-replayed, L2 flushed)."""
    p = problem(b, dev)
    rows = []
    mp = m_pad(b)
    default = projection_config(mp, torch.cuda.get_device_capability(dev))
    if mp <= 2:
        projs = [ProjectionConfig(2, 2048), ProjectionConfig(4, 2048), ProjectionConfig(2, 1024),
                 ProjectionConfig(2, 2048, num_warps=8), ProjectionConfig(4, 1024, num_warps=8)]
    else:
        projs = [dataclasses.replace(default, block_n=n, block_k=k, num_stages=s)
                 for n, k, s in ((16, 256, 4), (32, 256, 3), (16, 128, 4), (32, 128, 4), (64, 128, 3), (16, 512, 2))]
    for cfg in projs:
        for op, fn in (("qkv_rope", lambda: launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=cfg)),
                       ("out_proj", lambda: launch_decode_out_proj(p["attn"], p["wo"], None, p["hidden"], config=cfg))):
            t = timed(fn, dev, rep_ms=15)
            rows.append(dict(meta, batch=b, op=op, config=str(cfg), us=round(t.median_ms * 1e3, 2)))
    for block_s in (32, 64, 128):
        for splits in (None, 2, 4, 8, 16, 32):
            cfg = AttentionConfig(block_s=block_s, splits=splits)
            t = timed(lambda: launch_decode_attention(p["q"], p["k_cache"], p["v_cache"], p["positions"],
                                                      HEAD**-0.5, None, p["counters"], config=cfg), dev, rep_ms=15)
            rows.append(dict(meta, batch=b, op="attention", config=str(cfg), us=round(t.median_ms * 1e3, 2)))
    return rows


def main(argv):
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: decode_attention.py OUT_DIR [--no-sweep]")
    out = Path(argv[0])
    dev = torch.device("cuda")
    meta = run_metadata(dev)
    rows = []
    for b in BATCHES:
        rows += measure(b, dev, meta)
        write_csv(rows, out / "decode_attention.csv", FIELDS)
    if "--no-sweep" not in argv:
        sweep_rows = []
        for b in BATCHES:
            sweep_rows += sweep(b, dev, meta)
            write_csv(sweep_rows, out / "decode_attention_sweep.csv", (*meta, "batch", "op", "config", "us"))
        print("fastest configs (us):")
        for b in BATCHES:
            for op in ("qkv_rope", "attention", "out_proj"):
                best = min((r for r in sweep_rows if r["batch"] == b and r["op"] == op), key=lambda r: r["us"])
                print(f"  B={b:<3} {op:<10} {best['us']:>8.2f}  {best['config']}")
    print(f"{'batch':>5} {'op':<10} {'provider':<20} {'us':>8} {'GB/s':>7} {'roofline us':>11} {'rel_err':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['op']:<10} {r['provider']:<20} {r['us']:>8.2f} {r['gb_s']:>7.0f} "
              f"{r['roofline_us']:>11.2f} {r['rel_err']:>8}")


if __name__ == "__main__":
    main(sys.argv[1:])
