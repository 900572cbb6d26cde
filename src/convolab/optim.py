"""Optimizers updating a Network's parameters in place (so layers keep their array references)."""

from __future__ import annotations

import math
from typing import Any

from convolab.backend import xp_of
from convolab.network import Network

Array = Any


class Optimizer:
    def __init__(self, network: Network, lr: float, weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.network, self.lr, self.weight_decay = network, lr, weight_decay
        self.state: dict[str, dict[str, Array]] = {}
        self.steps = 0

    def step(self) -> None:
        """One update from the gradients of the last backward."""
        params, grads = self.network.params(), self.network.grads()
        missing = sorted(set(params) - set(grads))
        if missing:
            raise RuntimeError(f"no gradient for {missing}: call backward before step")
        self.steps += 1
        for name, p in params.items():
            g = grads[name]
            if self.weight_decay:
                g = g + self.weight_decay * p  # classic L2: the decay goes through the moments
            self._update(name, p, g.astype(p.dtype, copy=False))

    def _update(self, name: str, p: Array, g: Array) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """v = momentum * v + g; p -= lr * v (PyTorch's convention)."""

    def __init__(self, network: Network, lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        super().__init__(network, lr, weight_decay)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def _update(self, name: str, p: Array, g: Array) -> None:
        if not self.momentum:
            p -= self.lr * g
            return
        v = self.state.setdefault(name, {"v": xp_of(p).zeros_like(p)})["v"]
        v *= self.momentum
        v += g
        p -= self.lr * v


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction."""

    def __init__(self, network: Network, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(network, lr, weight_decay)
        self.beta1, self.beta2 = betas
        self.eps = eps

    def _update(self, name: str, p: Array, g: Array) -> None:
        xp = xp_of(p)
        s = self.state.setdefault(name, {"m": xp.zeros_like(p), "v": xp.zeros_like(p)})
        m, v = s["m"], s["v"]
        m *= self.beta1
        m += (1 - self.beta1) * g
        v *= self.beta2
        v += (1 - self.beta2) * g * g
        m_hat_scale = 1 / (1 - self.beta1**self.steps)
        v_hat_scale = 1 / (1 - self.beta2**self.steps)
        p -= (self.lr * m_hat_scale) * m / (xp.sqrt(v * v_hat_scale) + self.eps)


def cosine_lr(base_lr: float, step: int, total_steps: int, warmup_steps: int = 0,
              min_lr: float = 0.0) -> float:
    """Linear warm-up, then cosine decay from base_lr to min_lr at total_steps."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))
