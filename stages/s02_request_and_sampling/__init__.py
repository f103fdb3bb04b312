"""Stage 2: requests and sampling - ``Req``, ``SamplingParams``, temperature / top-k / top-p /
min-p, per-request seeds, stop tokens and stop strings, finish reasons."""
