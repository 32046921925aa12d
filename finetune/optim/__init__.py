"""The optimizer family: AdamW (``adamw.py``) and its data-parallel sharded version (``sharded.py``)
behind one typed interface (:class:`Optimizer`), the update pieces they share (``update.py``) and
the step bookkeeping of the loop (``health.py``). Runs inside every rank (MindSpore).

A test that replaces the update kernel patches ``finetune.optim.update.adamw_update``, where the
step gate looks it up.
"""
from finetune.optim.adamw import AdamW as AdamW
from finetune.optim.adamw import Optimizer as Optimizer
from finetune.optim.health import LossScaler as LossScaler
from finetune.optim.health import SkippedSteps as SkippedSteps
from finetune.optim.health import UpdateCheck as UpdateCheck
from finetune.optim.sharded import ShardedAdamW as ShardedAdamW
from finetune.optim.update import KernelScalars as KernelScalars
from finetune.optim.update import adamw_update as adamw_update
from finetune.optim.update import lr_at as lr_at
