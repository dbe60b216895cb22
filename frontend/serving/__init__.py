"""What every generating route shares: request -> sampling parameters, engine requests in flight, SSE framing."""
