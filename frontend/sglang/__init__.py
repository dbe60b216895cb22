"""SGLang's own API: /generate with sampling_params and meta_info."""
