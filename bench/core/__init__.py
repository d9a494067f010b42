"""The benchmark suite's core, which no benchmark module is part of: ``schema`` (the result format
and its helpers), ``runner`` (running and supervising processes), ``registry`` (``Benchmark``,
``register``) and ``cli`` (``python -m bench``)."""
