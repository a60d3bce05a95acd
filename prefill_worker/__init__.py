"""The prefill worker: runs prompts, samples the first token, hands the KV to a decode worker."""
