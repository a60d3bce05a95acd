"""What both workers share to serve the engine over gRPC: the worker config, the engine loop thread, the
proto conversions and the common servicer parts. Role policy lives in `prefill_worker/` and `decode_worker/`."""
