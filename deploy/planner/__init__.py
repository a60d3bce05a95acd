"""Profiles and plans: `splitserve profile` measures one worker of each role with the real engine
(`profiler.py`, torch); `splitserve plan` turns a profile and a traffic mix into ranked layouts (`planner.py`, a pure
function over `profile.py`'s dataclasses, with the queueing model in `queueing.py`); `validate.py` compares a bench
report with a plan. Nothing here imports torch at package import."""
