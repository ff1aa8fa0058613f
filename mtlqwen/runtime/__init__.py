"""Runtime: slots and sequences, the KV manager (block pool + prefix cache), the token-budget scheduler,
batch packing, sampling and the engine loop (design.md, "One engine step")."""

from .block_pool import BlockPool, NoFreeBlocks
from .config import EngineConfig
from .engine import Engine
from .kv_manager import KVManager
from .outputs import Delta, Output
from .sampling import SamplingParams
from .scheduler import ScheduledSeq, Scheduler, StepPlan, split_budget
from .sequence import Sequence, SeqStatus
from .structured import Structure

__all__ = [
    "BlockPool", "Delta", "Engine", "EngineConfig", "KVManager", "NoFreeBlocks", "Output", "SamplingParams", "ScheduledSeq", "Scheduler",
    "SeqStatus", "Sequence", "StepPlan", "Structure", "split_budget",
]
