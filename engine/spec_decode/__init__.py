"""Speculative decoding: proposers (one file each), the config, the dynamic policy and its cost model, and the
speculator that ties them into the engine step. Imports nothing heavy: the control-plane parts are torch-free."""
