"""Prefill/decode disaggregation on the frontend: the peers' request fields to KV transfers and
the fields a producer's answer gives back (requests.py), the lease registry its bootstrap serves
(bootstrap.py), and registration with LMDeploy's proxy (lmdeploy_proxy.py)."""
