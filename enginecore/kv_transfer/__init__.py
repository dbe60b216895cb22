"""Prefill/decode disaggregation in the engine core (docs/disaggregation.md).

A producer lends the KV blocks of the prompts it computed (leases.py); a consumer parks a request
while a thread pulls those blocks from the producer's worker ranks (puller.py), then schedules it
with them as its computed prefix. The files that carry blocks between processes: files.py.
"""
