"""Speculative decoding: proposers (one file each), the dynamic policy and its cost model, and the speculator that
ties them into the engine step; its config, `SpeculativeConfig`, is engine/config.py's. Imports nothing heavy: the
control-plane parts are torch-free."""
