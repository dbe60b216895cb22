"""A worker rank's part in prefill/decode disaggregation: lending its KV blocks (lender.py) and
writing pulled ones into its cache (loader.py). The engine core decides what moves
(enginecore/kv_transfer/)."""
