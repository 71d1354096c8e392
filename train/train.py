#!/usr/bin/env python3
"""Train the entmaxkv language model (train/MODEL.md) on data/train.txt.

Wall-clock budget: the run trains for --seconds of training time (evaluation excluded);
the learning rate warms up linearly over --warmup steps, then follows a cosine from --lr to
--lr * --min-lr-frac as a function of the fraction of the budget used. Checkpoints
(--out/state.pt: model, optimizer, step, time used) are written every --ckpt-every seconds
and at the end; a run whose --out holds a state.pt resumes from it. At the end the script
writes --out/model_fp32.safetensors (weights only, numpy-readable) and evaluates the whole
validation split and passkey retrieval.

Usage (GPU machine): python3 train/train.py --seconds 420 --out ckpt --log ckpt/log.txt
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

def parse_args():
    ap = argparse.ArgumentParser(description="train the entmaxkv LM")
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", default="ckpt")
    ap.add_argument("--log", default=None)
    ap.add_argument("--seconds", type=float, default=420.0, help="training time budget (s)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--passkey-frac", type=float, default=0.15)
    ap.add_argument("--answer-weight", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds of training between evals")
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--ckpt-every", type=float, default=120.0)
    ap.add_argument("--final-passkey", default="1024:32,2048:32,4096:16,8192:8",
                    help="LENGTH:COUNT list evaluated at the end")
    ap.add_argument("--init", default=None, help="start from these weights (safetensors), fresh optimizer")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--wall-limit", type=float, default=0.0,
                    help="also stop training this many seconds after the script started (0: off)")
    return ap.parse_args()


# --help answers here, before the imports that need numpy or torch
ARGS = parse_args() if __name__ == "__main__" else None

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, LM  # noqa: E402
import passkey  # noqa: E402
import st_io  # noqa: E402

LN2 = math.log(2.0)


def load_text(data_dir, name):
    p = os.path.join(data_dir, name + ".txt")
    if os.path.exists(p):
        with open(p, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)
    with gzip.open(p + ".gz", "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8)


class Logger:
    def __init__(self, path):
        self.f = open(path, "a") if path else None

    def __call__(self, msg):
        line = time.strftime("%H:%M:%S ") + msg
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def lr_at(step, progress, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(max(progress, 0.0), 1.0)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def make_batch(train_gpu, train_np, B, T, n_pk, rng, gen, device, answer_weight):
    """B sequences of T+1 bytes: B - n_pk random slices of the training text and n_pk
    passkey sequences (filler from the training text). Returns inputs, targets, weights,
    and a mask of the text rows."""
    n_txt = B - n_pk
    starts = torch.randint(0, train_gpu.numel() - T - 1, (n_txt,), device=device, generator=gen)
    idx = starts[:, None] + torch.arange(T + 1, device=device)[None, :]
    rows = [train_gpu[idx].long()]
    w = torch.ones(B, T, device=device)
    if n_pk:
        pk = []
        for r in range(n_pk):
            seq, ans = passkey.training_sequence(train_np, T + 1, rng)
            pk.append(np.frombuffer(seq, dtype=np.uint8))
            # the target at input position i is byte i + 1: the key bytes are targets of
            # positions ans - 1 .. ans + 3
            w[n_txt + r, ans - 1:ans - 1 + passkey.KEY_DIGITS] = answer_weight
        rows.append(torch.from_numpy(np.stack(pk)).to(device).long())
    seqs = torch.cat(rows, 0)
    return seqs[:, :-1], seqs[:, 1:], w, n_txt


@torch.no_grad()
def evaluate(model, val_np, T, device, max_seqs=None, batch=32):
    """Mean loss (nats/byte) over non-overlapping T+1 windows of the validation text."""
    n = (len(val_np) - 1) // T
    if max_seqs:
        n = min(n, max_seqs)
    tot, cnt = 0.0, 0
    for s in range(0, n, batch):
        e = min(n, s + batch)
        x = np.stack([val_np[i * T:i * T + T + 1] for i in range(s, e)])
        x = torch.from_numpy(x).to(device).long()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    return tot / max(cnt, 1), cnt


@torch.no_grad()
def passkey_accuracy(model, val_np, length, count, device, seed=1234, batch=8):
    """Exact-match accuracy of the 5-digit key (teacher-forced argmax at each key position,
    which equals greedy decoding of 5 tokens) and per-digit accuracy."""
    rng = np.random.default_rng(seed + length)
    seqs, keys = [], []
    for i in range(count):
        key = passkey.random_key(rng)
        depth = (i + 0.5) / count
        start = int(rng.integers(0, len(val_np)))
        p = passkey.make_prompt(val_np, length, depth, key, start)
        seqs.append(np.frombuffer(p + key.encode("ascii"), dtype=np.uint8))
        keys.append(key)
    exact, digits = 0, 0
    for s in range(0, count, batch):
        x = torch.from_numpy(np.stack(seqs[s:s + batch])).to(device).long()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        pred = logits[:, length - 1:length - 1 + passkey.KEY_DIGITS].argmax(-1)
        tgt = x[:, length:length + passkey.KEY_DIGITS]
        ok = pred == tgt
        exact += ok.all(-1).sum().item()
        digits += ok.sum().item()
    return exact / count, digits / (count * passkey.KEY_DIGITS)


def check_entmax(fn, device, log):
    """-inf (the causal mask) must give exactly zero probability, finite values and gradients."""
    z = torch.randn(4, 3, 16, 16, device=device, dtype=torch.float32) * 3
    z = z.masked_fill(torch.triu(torch.ones(16, 16, dtype=torch.bool, device=device), 1), float("-inf"))
    z.requires_grad_(True)
    p = fn(z)
    ok = torch.isfinite(p).all().item() and (p[..., torch.triu(torch.ones(16, 16, dtype=torch.bool, device=device), 1)] == 0).all().item()
    ok = ok and torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-5)
    (p * torch.randn_like(p)).sum().backward()
    ok = ok and torch.isfinite(z.grad).all().item()
    zeros = (p == 0).float().mean().item()
    log("entmax check with -inf mask: %s (fraction of exact zeros %.3f)" % ("ok" if ok else "FAILED", zeros))
    if not ok:
        raise SystemExit("entmax15 mishandles -inf")


def save_weights_fp32(model, path):
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    st_io.write(path, sd, model.c.metadata())


def main():
    a = ARGS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(a.out, exist_ok=True)
    log = Logger(a.log)
    t_start = time.time()

    train_np = load_text(a.data, "train")
    val_np = load_text(a.data, "val")
    train_gpu = torch.from_numpy(train_np.copy()).to(device)

    c = Config(train_ctx=a.ctx)
    model = LM(c).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "tok_embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    step, used, tokens_seen = 0, 0.0, 0
    state_path = os.path.join(a.out, "state.pt")
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, used, tokens_seen = st["step"], st["used"], st["tokens"]
        log("resumed from %s: step %d, %.1f s used, %d tokens" % (state_path, step, used, tokens_seen))
    elif a.init:
        w, _ = st_io.read(a.init)
        model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in w.items()})
        log("initialised from %s" % a.init)
    else:
        model.init_weights(a.seed)
    log("device %s (%s), torch %s, params %d, train %d bytes, val %d bytes, config %s"
        % (device, torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch.__version__,
           model.num_params(), len(train_np), len(val_np), json.dumps(c.metadata())))
    log("args %s" % json.dumps(vars(a)))

    rng = np.random.default_rng(a.seed * 1000003 + step)
    gen = torch.Generator(device=device)
    gen.manual_seed(a.seed * 7919 + step)
    B, T = a.batch, a.ctx
    n_pk = int(round(B * a.passkey_frac))

    def checkpoint():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "used": used,
                    "tokens": tokens_seen, "config": c.metadata()}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    last_eval = used
    last_ckpt = used
    run_t0 = time.time()
    run_used0 = used
    window = []
    model.train()
    check_entmax(model.entmax_fn, device, log)
    while used < a.seconds and (a.max_steps == 0 or step < a.max_steps):
        if a.wall_limit and time.time() - t_start > a.wall_limit:
            log("wall-clock limit reached, stopping early")
            break
        t0 = time.time()
        lr = lr_at(step, used / a.seconds, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, w, n_txt = make_batch(train_gpu, train_np, B, T, n_pk, rng, gen, device, a.answer_weight)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, c.vocab), y.reshape(-1), reduction="none").view(B, T)
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        text_loss = ce[:n_txt].mean()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        used += dt
        step += 1
        tokens_seen += B * T
        window.append((dt, text_loss.item(), gnorm.item()))
        if step <= 3 or step % 50 == 0:
            mdt = sum(v[0] for v in window) / len(window)
            ml = sum(v[1] for v in window) / len(window)
            log("step %d lr %.2e train_loss %.4f (%.4f bpb) gnorm %.2f step %.3f s %.0f tok/s used %.0f/%.0f s tokens %d"
                % (step, lr, ml, ml / LN2, window[-1][2], mdt, B * T / mdt, used, a.seconds, tokens_seen))
            window = []
            if not math.isfinite(ml):
                log("non-finite loss, stopping")
                sys.exit(3)
        if used - last_eval >= a.eval_every:
            model.eval()
            vl, _ = evaluate(model, val_np, T, device, a.eval_seqs)
            acc, dacc = passkey_accuracy(model, val_np, T, 32, device)
            model.train()
            log("eval step %d val_loss %.4f (%.4f bpb, first %d seqs) passkey@%d exact %.3f digits %.3f"
                % (step, vl, vl / LN2, a.eval_seqs, T, acc, dacc))
            last_eval = used
        if used - last_ckpt >= a.ckpt_every:
            checkpoint()
            last_ckpt = used
    checkpoint()
    wall = time.time() - run_t0
    log("trained: step %d, tokens %d, %.1f s of training in this run (%.1f s wall), %.1f s in total"
        % (step, tokens_seen, used - run_used0, wall, used))
    save_weights_fp32(model, os.path.join(a.out, "model_fp32.safetensors"))

    model.eval()
    vl, n = evaluate(model, val_np, T, device)
    log("final val_loss %.4f nats/byte = %.4f bpb over %d bytes (windows of %d)" % (vl, vl / LN2, n, T))
    x, y, w, n_txt = make_batch(train_gpu, train_np, 64, T, 0, rng, gen, device, 1.0)
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        tl = F.cross_entropy(model(x).reshape(-1, c.vocab), y.reshape(-1)).item()
    log("final train_loss %.4f nats/byte = %.4f bpb (64 random windows of %d)" % (tl, tl / LN2, T))
    res = {"step": step, "tokens": tokens_seen, "train_seconds": used, "val_loss": vl, "val_bpb": vl / LN2,
           "train_loss": tl, "train_bpb": tl / LN2, "passkey": {}}
    for item in a.final_passkey.split(","):
        if not item:
            continue
        L, cnt = (int(v) for v in item.split(":"))
        acc, dacc = passkey_accuracy(model, val_np, L, cnt, device, batch=max(1, 8192 // L))
        res["passkey"][L] = {"exact": acc, "digits": dacc, "count": cnt}
        log("final passkey@%d exact %.3f digits %.3f (%d prompts)" % (L, acc, dacc, cnt))
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    log("done in %.1f s wall" % (time.time() - t_start))


if __name__ == "__main__":
    main()
