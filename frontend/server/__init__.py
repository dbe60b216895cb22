"""The HTTP server itself: the Starlette app and its route table, middleware, errors, OpenAPI, metrics."""
