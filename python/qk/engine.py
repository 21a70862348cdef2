"""The inference engine: ``qk.Engine`` (the native ``qk._qk.Engine``): a model or a layer range of it
on one GPU, with independent slots, ``generate``/``stage_run``/``step``/``logits``, state snapshots,
``info()`` and ``counters()``.

>>> import qk
>>> eng = qk.Engine("model.gguf", slots=2, ctx=4096)  # doctest: +SKIP
>>> eng.generate([1, 2, 3], max_new=8)  # doctest: +SKIP
"""

from __future__ import annotations

from qk._qk import Engine

__all__ = ["Engine"]
