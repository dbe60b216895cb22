"""tern on Ray Serve: TernServer (a replica that is a whole tern server; Ray Serve LLM's
server_cls), the builders of its applications, and the dev control routes (docs/ray.md)."""
