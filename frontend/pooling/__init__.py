"""Pooling models' routes: embeddings, /pooling, /classify, /score, LMDeploy's /v1/encode."""
