"""The swap layer: async tensor I/O (SwapEngine), swap files with slots (SwapSpace), pinned
host memory (PinnedArena), file <-> GPU staging (CudaStager) and the fault-injection seam."""
from pyinfinity.swap.arena import PinnedArena, Slab
from pyinfinity.swap.engine import FileHandle, Request, SwapEngine
from pyinfinity.swap.faults import fault_injection, faults_injected
from pyinfinity.swap.space import Slot, SwapSpace
from pyinfinity.swap.stager import CudaStager, cuda_available

__all__ = ["SwapEngine", "Request", "FileHandle", "SwapSpace", "Slot", "PinnedArena", "Slab",
           "CudaStager", "cuda_available", "fault_injection", "faults_injected"]
