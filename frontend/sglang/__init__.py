"""SGLang's native API: /generate with sampling_params and meta_info."""
