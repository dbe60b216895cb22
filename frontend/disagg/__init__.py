"""Prefill/decode disaggregation on the frontend: the peers' request fields to KV transfers
(requests.py), what a producer answers (answers.py), and the lease registry its bootstrap serves
(bootstrap.py)."""
