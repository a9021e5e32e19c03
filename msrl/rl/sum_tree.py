"""A sum tree over transition priorities, in tensors on the buffer's device: proportional
prioritized sampling in ``O(log n)`` per draw, every draw of a batch at once (Schaul et al. 2016,
"Prioritized Experience Replay", Appendix B.2.1).

The tree is one float64 tensor of ``2P`` nodes (``P``: the capacity rounded up to a power of
two): node 1 is the root, node ``i`` has children ``2i`` and ``2i + 1``, leaf ``j`` is node
``P + j``. Updates rewrite the leaves and then each level's parents, level by level (one
vectorised step per level, no Python loop over items); a draw descends from the root, every
draw of a batch side by side. float64 keeps the sums exact enough that a draw never lands past
the last non-zero leaf through rounding (and one that would is clamped to the stored rows).
"""

from __future__ import annotations

import torch

__all__ = ["SumTree"]


class SumTree:
    """Priorities of ``capacity`` slots and their sums.

    Args:
        capacity: the number of leaves, >= 1.
        device: where the tree lives.

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"a sum tree needs capacity >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.leaves = 1 << (self.capacity - 1).bit_length()  # P, a power of two
        self.depth = self.leaves.bit_length() - 1
        self.tree = torch.zeros(2 * self.leaves, dtype=torch.float64, device=device)

    @property
    def total(self) -> torch.Tensor:
        """The sum of every priority, a 0-d float64 tensor."""
        return self.tree[1]

    def get(self, index: torch.Tensor) -> torch.Tensor:
        """The priorities of slots ``index`` (int64, any shape), float64 of its shape."""
        return self.tree[self.leaves + index]

    def set(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Sets slots ``index`` (int64 ``(k,)``) to ``priority`` (``(k,)``, >= 0) and updates
        their ancestors' sums. A slot listed twice takes its last priority.

        Raises:
            ValueError: an index outside ``[0, capacity)``, a negative or non-finite priority
                (on the CPU, where checking costs no device sync).
        """
        index = index.reshape(-1).long()
        priority = priority.reshape(-1).to(torch.float64)
        if index.numel() == 0:
            return
        if index.device.type == "cpu":
            if int(index.min()) < 0 or int(index.max()) >= self.capacity:
                raise ValueError(f"sum tree index out of [0, {self.capacity}): {index.min().item()}..{index.max().item()}")
            if not torch.isfinite(priority).all() or bool((priority < 0).any()):
                raise ValueError("priorities must be finite and >= 0")
        # the last occurrence of each slot wins (index_put with repeated indices picks any one)
        order = torch.arange(index.numel(), device=index.device)
        last = torch.full((self.capacity,), -1, dtype=torch.int64, device=index.device)
        last.scatter_reduce_(0, index, order, reduce="amax")
        keep = last[index] == order
        nodes = self.leaves + index[keep]
        self.tree[nodes] = priority[keep]
        for _ in range(self.depth):
            nodes = torch.unique(nodes // 2)
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]

    def find(self, mass: torch.Tensor, size: int) -> torch.Tensor:
        """The slots whose cumulative priority intervals hold ``mass`` (float ``(k,)`` in
        ``[0, total)``): slot ``j`` for ``sum(p_<j) <= m < sum(p_<=j)``, int64 ``(k,)``, clamped to
        the first ``size`` slots (the stored rows)."""
        node = torch.ones(mass.shape, dtype=torch.int64, device=mass.device)
        m = mass.to(torch.float64)
        for _ in range(self.depth):
            left = self.tree[2 * node]
            right = m >= left
            m = torch.where(right, m - left, m)
            node = 2 * node + right.long()
        return (node - self.leaves).clamp_(0, max(size - 1, 0))

    def sample(self, shape: tuple[int, ...], size: int, generator: torch.Generator) -> torch.Tensor:
        """Draws ``prod(shape)`` slots with probability proportional to their priority,
        stratified: the mass ``[0, total)`` cut into ``prod(shape)`` equal segments, one uniform
        draw in each (Schaul et al. 2016, Appendix B.2.1), in a random order; int64 of ``shape``.

        Raises:
            RuntimeError: every priority is 0.
        """
        k = 1
        for s in shape:
            k *= s
        total = self.total
        if self.tree.device.type == "cpu" and float(total) <= 0.0:
            raise RuntimeError("every priority in the replay is 0: nothing can be drawn")
        u = torch.rand(k, generator=generator, device=self.tree.device, dtype=torch.float64)
        segment = total / k
        mass = (torch.arange(k, device=self.tree.device, dtype=torch.float64) + u) * segment
        perm = torch.randperm(k, generator=generator, device=self.tree.device)
        return self.find(mass[perm], size).view(shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tree's array (``(2 * capacity,)`` float priorities, shared, not copied)."""
        return {"tree": self.tree}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict`'s output (same capacity).

        Raises:
            ValueError: a tree of another size.
        """
        tree = state["tree"]
        if tree.shape != self.tree.shape:
            raise ValueError(f"a sum tree of {tree.shape[0] // 2} leaves cannot load into one of {self.leaves}")
        self.tree.copy_(tree)
