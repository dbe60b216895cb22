"""Text processing: tokenizer, incremental detokenizer, reasoning and tool-call parsers, structured-output specs, logprob strings."""
