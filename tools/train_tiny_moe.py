"""Train the bundled tiny Qwen2-MoE on the pre-tokenized Wikipedia corpus (GPU machine).

What it does: builds a Qwen2-MoE-architecture model with ``transformers`` (so it loads through
the same path as Qwen1.5-MoE-A2.7B), trains it under bf16 autocast with AdamW for a fixed
wall-clock budget (the learning-rate schedule follows elapsed time, so the run always ends
on schedule), evaluates held-out loss and per-expert routing mass, and saves it with
``save_pretrained`` in bf16, sharded. It does not tokenize (``tools/prepare_corpus.py``)
and does not measure WikiText-2 perplexity (``pwrun ppl`` does, with the project's code).

Usage (on the GPU machine)::

    python tools/train_tiny_moe.py --data .data/corpus --tokenizer .data/tokenizer \
        --out $OUT/model --time-budget 480
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM


def build_config(vocab_size: int, eos_id: int, args: argparse.Namespace) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # unused: every layer is sparse (decoder_sparse_step=1)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        moe_intermediate_size=args.expert_intermediate,
        shared_expert_intermediate_size=args.shared_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def count_params(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n)
    return {"total": total, "routed_experts": routed, "shared_expert": shared}


def batches(data: np.ndarray, batch: int, seq_len: int, gen: np.random.Generator, device: str):
    while True:
        starts = gen.integers(0, data.size - seq_len - 1, size=batch)
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        x = torch.from_numpy(data[idx].astype(np.int64)).to(device, non_blocking=True)
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, device: str, max_windows: int = 256) -> dict:
    model.eval()
    n = min(max_windows, (data.size - 1) // seq_len)
    losses, mass, pos_sum = [], None, None
    for i in range(0, n, 32):
        rows = [data[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n, i + 32))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], output_router_logits=True)
        tok_loss = F.cross_entropy(out.logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        losses.append(tok_loss.sum().item())
        by_pos = tok_loss.view(x.shape[0], -1).sum(dim=0)
        pos_sum = by_pos if pos_sum is None else pos_sum + by_pos
        per_layer = []
        for logits in out.router_logits:
            probs = torch.softmax(logits.float(), dim=-1)
            w, idx = probs.topk(model.config.num_experts_per_tok, dim=-1)
            m = torch.zeros(model.config.num_experts, device=device).index_add_(0, idx.flatten(), w.flatten())
            per_layer.append(m)
        stacked = torch.stack(per_layer)
        mass = stacked if mass is None else mass + stacked
    model.train()
    mass = (mass / mass.sum(dim=1, keepdim=True)).cpu().numpy()
    # mean loss over position bands [lo, hi): does the model use the context it was trained on?
    per_pos = (pos_sum / n).cpu().numpy()
    bands, lo = {}, 0
    while lo < seq_len:
        hi = min(seq_len, max(256, 2 * lo))
        bands[f"{lo}-{hi}"] = round(float(per_pos[lo:hi].mean()), 4)
        lo = hi
    return {"loss": sum(losses) / (n * seq_len), "loss_by_position": bands, "routing_mass": mass.round(5).tolist()}


def pick_experts_implementation(model, it, device: str) -> str:
    """Time a few forward+backward steps with each experts implementation; keep the faster."""
    best, best_t = "eager", float("inf")
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            for i in range(6):
                if i == 2:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t = time.time()
                x, y = next(it)
                with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                    out = model(input_ids=x, output_router_logits=True)
                F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten()).backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.time() - t
            print(f"probe {impl}: {dt / 4 * 1e3:.1f} ms/step", flush=True)
            if dt < best_t:
                best, best_t = impl, dt
        except Exception as exc:  # an implementation may not run on this GPU/dtype
            print(f"probe {impl} failed: {exc!r}", flush=True)
    model.zero_grad(set_to_none=True)
    model.set_experts_implementation(best)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds of training")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-intermediate", type=int, default=256)
    ap.add_argument("--shared-intermediate", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--aux-coef", type=float, default=0.001)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = args.device
    stats = json.loads((args.data / "stats.json").read_text())
    train = np.load(args.data / "train.npy")
    heldout = np.load(args.data / "heldout.npy")
    cfg = build_config(stats["vocab_size"], stats["eos_id"], args)
    model = Qwen2MoeForCausalLM(cfg).to(device)
    params = count_params(model)
    print(json.dumps(params), f"routed share {params['routed_experts'] / params['total']:.3f}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"))
    gen = np.random.default_rng(args.seed)
    it = batches(train, args.batch, args.seq_len, gen, device)
    impl = pick_experts_implementation(model, it, device)
    print(f"experts implementation: {impl}", flush=True)
    log, tokens, step = [], 0, 0
    t0 = time.time()
    warmup = 0.03
    while True:
        frac = (time.time() - t0) / args.time_budget
        if frac >= 1.0:
            break
        cosine = 0.5 * (1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))
        lr_scale = frac / warmup if frac < warmup else 0.1 + 0.9 * cosine
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        x, y = next(it)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            out = model(input_ids=x, labels=y, output_router_logits=True)
        # labels are already shifted: recompute the plain LM loss on our own targets
        lm = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
        loss = lm + args.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        step += 1
        if step % 50 == 0:
            el = time.time() - t0
            log.append({"step": step, "tokens": tokens, "seconds": round(el, 1), "lm_loss": round(lm.item(), 4),
                        "aux_loss": round(out.aux_loss.item(), 4), "lr": args.lr * lr_scale})
            print(json.dumps(log[-1]), f"{tokens / el / 1e3:.0f}k tok/s", flush=True)
    train_seconds = time.time() - t0
    ev = evaluate(model, heldout, args.seq_len, device)
    print(f"heldout loss {ev['loss']:.4f} ppl {math.exp(ev['loss']):.2f}; by position {ev['loss_by_position']}",
          flush=True)

    model.config.output_router_logits = False
    model.to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size="14MB")
    summary = {
        "params": params,
        "experts_implementation": impl,
        "routed_share": params["routed_experts"] / params["total"],
        "tokens_seen": tokens,
        "tokens_per_param": tokens / params["total"],
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / train_seconds),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "heldout_loss": ev["loss"],
        "heldout_ppl": math.exp(ev["loss"]),
        "heldout_loss_by_position": ev["loss_by_position"],
        "heldout_routing_mass": ev["routing_mass"],
        "log": log,
        "corpus": stats,
    }
    (args.out / "train_log.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
