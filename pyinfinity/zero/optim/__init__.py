"""The offloaded optimizer's parts (``zero.optimizer.OffloadOptimizer`` puts them together): the
state format, gradient intake, the CPU step, the device step, the background worker."""
from pyinfinity.zero.optim.formats import DEVICE_CHUNK, AdamFp32, OptimStateFormat
from pyinfinity.zero.optim.records import BackgroundStepFailed, ShardOptimState, StepResult
from pyinfinity.zero.optim.scaler import DynamicLossScaler

__all__ = ["AdamFp32", "BackgroundStepFailed", "DEVICE_CHUNK", "DynamicLossScaler", "OptimStateFormat",
           "ShardOptimState", "StepResult"]
