"""The basis a store keeps K/V in: the model's own (:class:`ModelBasis`) or a randomized Hadamard rotation per
KV head (:class:`RotatedBasis`, the seeded matrices of :func:`kvlab.kernels.turboquant.rotations`).

A store that has its own layout (KIVI's per-channel key groups and bf16 ring) takes one of these and
stays unchanged inside: K/V enter through ``stored``; the hf layer hands transformers ``read_back`` of
what it dequantized; the fast store attends in the stored basis, the query rotated once per step
(``queries``) and the weighted sum of values rotated back once (``output``). Attention is unchanged
by an orthogonal rotation (``q R . k R = q . k``); what the rotation changes is the quantizer's input
(an outlier channel spread over every coordinate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.kernels.turboquant import rotate, rotations, unrotate


class ModelBasis:
    """K/V as the model computes them: every map is the identity."""

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def read_back(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return out


@dataclass(frozen=True)
class RotatedBasis:
    """K/V rotated per KV head by ``matrix`` (``[Hkv, D, D]``, orthogonal); every map returns its input's dtype."""

    matrix: torch.Tensor

    @classmethod
    def seeded(cls, kv_heads: int, head_dim: int, seed: int, device) -> RotatedBasis:
        return cls(rotations(kv_heads, head_dim, seed).to(device))

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, n, D]`` into the rotated basis."""
        return rotate(x, self.matrix).to(x.dtype)

    def read_back(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, n, D]`` in the rotated basis back to the model's."""
        return unrotate(y.float(), self.matrix).to(y.dtype)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, D]`` queries (GQA: ``Hq / Hkv`` per KV head) into their KV head's rotated basis."""
        return self.grouped(q, self.matrix)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, D]`` weighted sums of rotated values back to the model's basis."""
        return self.grouped(out, self.matrix.transpose(-1, -2))

    @staticmethod
    def grouped(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        bsz, q_heads, d = x.shape
        kv_heads = matrix.shape[0]
        y = torch.matmul(x.float().reshape(bsz, kv_heads, q_heads // kv_heads, d), matrix)
        return y.reshape(bsz, q_heads, d).to(x.dtype)
