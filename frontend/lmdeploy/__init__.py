"""LMDeploy's native API: /generate with sessions, /abort_request."""
