"""Where a trial is measured: timing (``timing``), accuracy against the reference
(``accuracy``), the GPU it ran on (``hardware``), the compile warm-up of compile
processes (``compile_warmup``) and ``kharness bench`` (``bench``)."""
