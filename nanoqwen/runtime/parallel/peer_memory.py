"""Which tensor-parallel ranks can map each other's GPU memory (the custom collectives need
it), and opening a peer's shared buffers in this rank's device context."""

from __future__ import annotations

import io
import pickle
import socket
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor


@dataclass(frozen=True)
class RankInfo:
    """What the other ranks need to know to decide whether they can map this rank's GPU."""

    host: str
    device: int  # this rank's GPU, as this process numbers them
    visible: tuple[str, ...]  # UUID of every GPU this process sees, by index
    peer_access: tuple[bool, ...]  # whether this rank's GPU can map each of those
    programs: int  # streaming multiprocessors of this rank's GPU

    @classmethod
    def local(cls, device: torch.device) -> RankInfo:
        count = torch.cuda.device_count()
        return cls(
            host=socket.gethostname(),
            device=device.index,
            visible=tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(count)),
            peer_access=tuple(
                i == device.index or torch.cuda.can_device_access_peer(device.index, i)
                for i in range(count)
            ),
            programs=torch.cuda.get_device_properties(device).multi_processor_count,
        )


def refusal(infos: list[RankInfo]) -> str | None:
    """Why these ranks cannot use the custom all-reduce; None when they can. Every rank
    decides from the same gathered infos, so all agree."""
    if len({i.host for i in infos}) > 1:
        return "the ranks run on several machines"
    uuids = [i.visible[i.device] for i in infos]
    if len(set(uuids)) < len(uuids):
        return "two ranks share a GPU"
    for r, info in enumerate(infos):
        for q, uuid in enumerate(uuids):
            d = infos[q].device
            if d >= len(info.visible) or info.visible[d] != uuid:
                return f"rank {r} does not see rank {q}'s GPU as cuda:{d} (CUDA_VISIBLE_DEVICES)"
            if not info.peer_access[d]:
                return f"rank {r}'s GPU cannot access rank {q}'s GPU memory (no peer access)"
    return None


class PeerUnpickler(pickle.Unpickler):
    """Unpickles a peer's shared tensors with their CUDA IPC handles opened in this rank's
    device context (cudaIpcOpenMemHandle with lazy peer access, under that device), where
    the kernel reads and writes them. torch would open them under the peer's device index,
    a context this rank's kernels have no peer mapping from: an illegal address on the GPU.
    The tensors then name this rank's device; only their addresses are used."""

    def __init__(self, blob: bytes, device: torch.device) -> None:
        super().__init__(io.BytesIO(blob))
        self.device = device

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self._rebuild_here
        return super().find_class(module, name)

    def _rebuild_here(self, *args):
        args = list(args)
        args[6] = self.device.index  # storage_device
        return rebuild_cuda_tensor(*args)
