"""The frontend's media room: where an image a request names comes from, and whether it may come.

`policy.MediaPolicy` holds the operator's rules (the local folder, the domains, the per-prompt
limits, the byte, pixel and time caps); `sources.load_media_bytes` turns a `data:`, `file:` or
`http(s):` URL into bytes under those rules (`remote` does the SSRF-guarded fetch);
`images.decode_image` turns bytes into an RGB Pillow image; `limits` parses
`--limit-mm-per-prompt` and counts a prompt's items against it. Every refusal is an OpenAI-style
400 naming the request part (`param`). This room knows nothing of chat templates, processors or
models: it hands back bytes and images.
"""
