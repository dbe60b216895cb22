"""LMDeploy's own API: /generate with sessions, /abort_request."""
