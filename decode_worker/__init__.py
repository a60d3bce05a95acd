"""The decode worker: reserves blocks, receives a prompt's KV, decodes with continuous batching, streams tokens.
With role "colocated" it runs whole requests itself."""
