"""The offloaded optimizer's parts (``zero.optimizer.OffloadOptimizer`` puts them together): the
state format, gradient intake, the CPU step, the device step, the background worker."""
from pyinfinity.zero.optim.formats import (DEVICE_CHUNK, Adam8bit, AdamBf16, AdamFp32, OptimStateFormat,
                                          make_state_format)
from pyinfinity.zero.optim.records import BackgroundStepFailed, ShardOptimState, StepResult
from pyinfinity.zero.optim.scaler import DynamicLossScaler

__all__ = ["Adam8bit", "AdamBf16", "AdamFp32", "BackgroundStepFailed", "DEVICE_CHUNK", "DynamicLossScaler",
           "OptimStateFormat", "ShardOptimState", "StepResult", "make_state_format"]
