"""Train the inspection classifier on the procedural surface-defect set and export it.

    python3 examples/jetson_qc/train.py                 # ~1 min on 2 CPU cores; writes weights/
    python3 examples/jetson_qc/train.py --epochs 1 --train 800 --out /tmp/qc_weights   # a quick smoke run

Writes, into --out (default: the example's weights/ folder):
    qc_moe.colibri      the MoE layers, fp16, written with colibri_sdk.format.write_model
    qc_stem_head.npz    the stem and head for NumPy (float32)
    qc_train.json       sizes, seeds, epochs and the held-out accuracy

The MoE weights are rounded to fp16 before the held-out evaluation, so the accuracy printed is the accuracy of
exactly the weights shipped (the profile's dtype is fp16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qc.dataset import CLASSES, make_dataset  # noqa: E402
from qc.model import MOE_WEIGHTS, STEM_HEAD_WEIGHTS, WEIGHTS_DIR  # noqa: E402
from qc.preprocess import preprocess_batch  # noqa: E402

TRAIN_SEED = 1
HELD_OUT_SEED = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=6000, help="training frames (default 6000)")
    p.add_argument("--held-out", type=int, default=1200, help="held-out frames, another seed (default 1200)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="torch initialisation and shuffling seed")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="output folder (default: weights/ of the example)")
    return p.parse_args(argv)


def accuracy(net, images: np.ndarray, labels: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        logits = torch.cat([net(torch.from_numpy(images[i : i + 512])) for i in range(0, len(images), 512)])
    return float((logits.argmax(dim=1).numpy() == labels).mean())


def train(args) -> dict:
    import torch

    from colibri_sdk.format import Header, write_model
    from colibri_sdk.format.constants import COMPOSITION_RESIDUAL, DTYPE_CODES, ROUTING_TOPK_SOFTMAX
    from qc.torch_model import EXPERTS, INTERMEDIATE, TOP_K, QCNet

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    train_frames, train_labels = make_dataset(args.train, TRAIN_SEED)
    held_frames, held_labels = make_dataset(args.held_out, HELD_OUT_SEED)
    x_train, x_held = preprocess_batch(train_frames), preprocess_batch(held_frames)
    print(f"data: {len(x_train)} training + {len(x_held)} held-out frames in {time.perf_counter() - start:.1f} s")

    net = QCNet()
    optimiser = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * ((len(x_train) + args.batch - 1) // args.batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=args.lr, total_steps=max(steps, 1))
    images, labels = torch.from_numpy(x_train), torch.from_numpy(train_labels)
    generator = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        net.train()
        order = torch.randperm(len(images), generator=generator)
        total = 0.0
        for i in range(0, len(order), args.batch):
            idx = order[i : i + args.batch]
            batch = images[idx]
            # Augmentation: random flips and transposes (defects have no preferred orientation).
            if torch.rand(1, generator=generator) < 0.5:
                batch = batch.flip(2)
            if torch.rand(1, generator=generator) < 0.5:
                batch = batch.transpose(1, 2)
            loss = torch.nn.functional.cross_entropy(net(batch), labels[idx]) + 0.01 * net.balance_loss()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
            total += loss.item() * len(idx)
        net.eval()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {total / len(order):.4f}, "
              f"held-out accuracy {accuracy(net, x_held, held_labels):.4f}")

    net.round_moe_to_fp16()
    held_acc = accuracy(net, x_held, held_labels)
    print(f"held-out accuracy (MoE weights rounded to fp16): {held_acc:.4f} on {len(x_held)} frames")

    args.out.mkdir(parents=True, exist_ok=True)
    moe = net.moe_arrays()
    header = Header(num_layers=len(net.moe), num_experts=EXPERTS, top_k=TOP_K, hidden_size=moe["gate"].shape[-1],
                    intermediate_size=INTERMEDIATE, dtype=DTYPE_CODES["fp16"], routing=ROUTING_TOPK_SOFTMAX,
                    composition=COMPOSITION_RESIDUAL)
    moe_path = write_model(args.out / MOE_WEIGHTS.name, header, moe["gate"], moe["up"], moe["down"], moe["router"])
    np.savez(args.out / STEM_HEAD_WEIGHTS.name, **net.stem_head_arrays())
    report = {
        "classes": list(CLASSES),
        "train_frames": args.train, "train_seed": TRAIN_SEED,
        "held_out_frames": args.held_out, "held_out_seed": HELD_OUT_SEED,
        "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "torch_seed": args.seed,
        "held_out_accuracy": round(held_acc, 4),
        "header": header.to_dict(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (args.out / "qc_train.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"wrote {moe_path} ({moe_path.stat().st_size} bytes), {args.out / STEM_HEAD_WEIGHTS.name}, "
          f"{args.out / 'qc_train.json'} in {report['seconds']} s")
    return report


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
