"""The fine-tuning curve: ``metrics.jsonl`` records drawn as ``metrics.png`` (loss and task metric
against steps)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_metrics(records: list[dict], path: str, title: str) -> None:
    """Left: training and validation loss; right: validation token accuracy and, when scored, exact
    match."""
    figure, (losses, scores) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("train_loss", "train loss"), ("validation_loss", "validation loss")):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            losses.plot(*zip(*points), marker=".", label=label)
    for key, label in (
        ("validation_token_accuracy", "token accuracy"),
        ("validation_exact_match", "exact match"),
    ):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            scores.plot(*zip(*points), marker=".", label=label)
    losses.set(xlabel="step", ylabel="nats per target token", title="loss")
    scores.set(xlabel="step", ylabel="fraction", title="validation metric", ylim=(0, 1))
    for axes in (losses, scores):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    temporary = path + ".tmp.png"
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, path)
