"""The GDN state pool: per-request conv and recurrent states of the Gated DeltaNet layers.

A GDN layer keeps no per-token cache, only a fixed-size state per sequence:
  conv state       [n_gdn_layers, slots, conv_dim, kernel - 1]   model dtype (the last K-1 conv inputs)
  recurrent state  [n_gdn_layers, slots, Hv, Dv, Dk]             float32 by default (`gdn_state_dtype`)

Slot 0 is a dummy that padding rows (CUDA-graph batches) read and write. A running request owns
slot `row + 1`, where `row` is its ReqToTokenPool row, so a slot is taken and freed with the row
and there are `max_reqs + 1` slots. The scheduler zeroes a request's slot before its first extend
(also the recompute after a preemption); chunked prefill carries the state from chunk to chunk.

`GDNSlots` and `GDNSnapshots` are the two pools as the scheduler and the prefix cache see them:
sizes, snapshot ids handed out and freed, and the writes (zeroing slots, saving and restoring
snapshots). `GDNPool` and `GDNSnapshotPool` hold the states on the device; under tensor parallelism
the driver's stand-ins (cache/shadow.py) record the writes for the ranks instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vlmrun.host_to_device import upload


def gdn_slot_for_row(row: int) -> int:
    """The GDN slot of the request in ReqToTokenPool row `row` (slot 0 is the dummy)."""
    return row + 1


class GDNSlots(ABC):
    """The GDN state pool's size (`num_layers` GDN layers, `num_slots` slots with the dummy) and `zero`."""

    def __init__(self, num_layers: int, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"the GDN pool needs the dummy slot and at least one more, got {num_slots} slots")
        self.num_layers = num_layers
        self.num_slots = num_slots

    @abstractmethod
    def zero(self, slots: torch.Tensor) -> None:
        """Reset the states of `slots` [n] int64 in every GDN layer."""


class GDNPool(GDNSlots):
    """The conv and recurrent states of every slot, on the device."""

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 head_v_dim: int, head_k_dim: int, conv_dtype: torch.dtype, state_dtype: torch.dtype,
                 device: torch.device):
        super().__init__(num_layers, num_slots)
        self.conv_state = torch.zeros((num_layers, num_slots, conv_dim, conv_kernel - 1), dtype=conv_dtype,
                                      device=device)
        self.recurrent_state = torch.zeros((num_layers, num_slots, num_v_heads, head_v_dim, head_k_dim),
                                           dtype=state_dtype, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_kernel: int, num_v_heads: int, head_v_dim: int,
                       head_k_dim: int, conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        """Bytes of GDN state one request holds, over all GDN layers."""
        conv = conv_dim * (conv_kernel - 1) * conv_dtype.itemsize
        recurrent = num_v_heads * head_v_dim * head_k_dim * state_dtype.itemsize
        return num_layers * (conv + recurrent)

    def slot_bytes(self) -> int:
        return (self.conv_state[:, 0].numel() * self.conv_state.element_size()
                + self.recurrent_state[:, 0].numel() * self.recurrent_state.element_size())

    def zero(self, slots: torch.Tensor) -> None:
        """Zero both states of `slots` in place (no host sync)."""
        slots = upload(slots, self.conv_state.device)
        self.conv_state.index_fill_(1, slots, 0)
        self.recurrent_state.index_fill_(1, slots, 0)


class GDNSnapshots(ABC):
    """A bounded store of GDN states taken at prefix-cache boundaries (hybrid models): snapshot ids
    handed out and freed, and saving / restoring a slot's state. The prefix cache decides which
    snapshot belongs to which page."""

    def __init__(self, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"a snapshot pool needs at least one snapshot, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self.free_ids: list[int] = list(range(num_snapshots - 1, -1, -1))

    def alloc(self) -> int | None:
        return self.free_ids.pop() if self.free_ids else None

    def free(self, idx: int) -> None:
        self.free_ids.append(idx)

    def num_free(self) -> int:
        return len(self.free_ids)

    @abstractmethod
    def save(self, slot: int, idx: int) -> None:
        """Copy the state of GDN slot `slot` into snapshot `idx`."""

    @abstractmethod
    def restore(self, idx: int, slot: int) -> None:
        """Copy snapshot `idx` into GDN slot `slot`."""


class GDNSnapshotPool(GDNSnapshots):
    """The snapshots on the device. Snapshot i holds conv and recurrent state of every GDN layer:
      conv       [n_gdn_layers, num_snapshots, conv_dim, kernel - 1]
      recurrent  [n_gdn_layers, num_snapshots, Hv, Dv, Dk]
    with the dtypes of the `GDNPool` it copies from and to. Its memory is counted in the one cache
    budget (`plan_cache_memory`).
    """

    def __init__(self, pool: GDNPool, num_snapshots: int):
        super().__init__(num_snapshots)
        self.pool = pool
        conv, rec = pool.conv_state, pool.recurrent_state
        self.conv = torch.zeros((conv.shape[0], num_snapshots, *conv.shape[2:]), dtype=conv.dtype, device=conv.device)
        self.recurrent = torch.zeros((rec.shape[0], num_snapshots, *rec.shape[2:]), dtype=rec.dtype,
                                     device=rec.device)

    def save(self, slot: int, idx: int) -> None:
        """Copy slot `slot`'s states into snapshot `idx` (no host sync)."""
        self.conv[:, idx].copy_(self.pool.conv_state[:, slot])
        self.recurrent[:, idx].copy_(self.pool.recurrent_state[:, slot])

    def restore(self, idx: int, slot: int) -> None:
        """Copy snapshot `idx`'s states into slot `slot` (no host sync)."""
        self.pool.conv_state[:, slot].copy_(self.conv[:, idx])
        self.pool.recurrent_state[:, slot].copy_(self.recurrent[:, idx])
